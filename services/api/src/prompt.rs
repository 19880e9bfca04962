//! From OpenAI messages to prompt ids: messages in transformers' form, the chat
//! template, the tokenizer, and each media placeholder (`<image>`, `<|AUDIO|>`)
//! expanded to its item's virtual token-id range.

use mmserve_text::{ChatTemplate, TextTokenizer};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::openai::{AudioSource, Content, Message, Part, parse_part};

/// A media item of the request, where its bytes are.
#[derive(Debug, Clone)]
pub enum ItemSource {
    Image(String),
    Audio(AudioSource),
}

/// Messages as the template sees them, and the media items in order of appearance.
pub struct ParsedMessages {
    pub template_messages: Value,
    pub items: Vec<ItemSource>,
    /// Bytes of text in all messages.
    pub text_bytes: usize,
}

pub fn parse_messages(messages: &[Message]) -> Result<ParsedMessages, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_param("messages", "`messages` must not be empty"));
    }
    let mut out = Vec::with_capacity(messages.len());
    let mut items = Vec::new();
    let mut text_bytes = 0usize;
    for (i, m) in messages.iter().enumerate() {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "developer") {
            return Err(ApiError::bad_param("messages", format!("messages[{i}]: unsupported role {:?}", m.role)));
        }
        // Templates written for multimodal models iterate over parts, so text becomes
        // a list of one text part.
        let parts: Vec<Value> = match &m.content {
            None => Vec::new(),
            Some(Content::Text(t)) => {
                text_bytes += t.len();
                vec![json!({"type": "text", "text": t})]
            }
            Some(Content::Parts(parts)) => {
                let mut v = Vec::with_capacity(parts.len());
                for (j, p) in parts.iter().enumerate() {
                    match parse_part(p, &format!("messages[{i}].content[{j}]"))
                        .map_err(|e| ApiError::bad_param("messages", e))?
                    {
                        Part::Text(t) => {
                            text_bytes += t.len();
                            v.push(json!({"type": "text", "text": t}))
                        }
                        Part::ImageUrl(url) => {
                            items.push(ItemSource::Image(url));
                            v.push(json!({"type": "image"}));
                        }
                        Part::Audio(src) => {
                            items.push(ItemSource::Audio(src));
                            v.push(json!({"type": "audio"}));
                        }
                    }
                }
                v
            }
        };
        out.push(json!({"role": m.role, "content": parts}));
    }
    Ok(ParsedMessages { template_messages: Value::Array(out), items, text_bytes })
}

/// Refuses, before any tokenizing, text that cannot fit the context whatever it says:
/// no token stands for more than `max_token_bytes` of text (halved for what
/// normalisation may remove). Tokenizing costs many times the text's size in memory.
pub fn check_text_fits(text_bytes: usize, max_token_bytes: usize, context: u64) -> Result<(), ApiError> {
    let at_least = text_bytes / (2 * max_token_bytes.max(1));
    if at_least as u64 > context {
        return Err(ApiError::bad_param(
            "messages",
            format!(
                "the messages hold {text_bytes} bytes of text, at least {at_least} tokens: more than this model's context of {context} tokens"
            ),
        ));
    }
    Ok(())
}

/// Renders and tokenizes; returns the ids with placeholders still in place.
pub fn tokenize(template: &ChatTemplate, tokenizer: &TextTokenizer, messages: &Value) -> Result<Vec<u32>, ApiError> {
    let text = template.render(messages, true).map_err(|e| ApiError::bad(e.to_string()))?;
    tokenizer.encode_prompt(&text).map_err(|e| ApiError::Internal(e.to_string()))
}

/// Replaces the n-th placeholder with the n-th range.
pub fn expand(ids: &[u32], placeholder: u32, ranges: &[(u64, u32)]) -> Result<Vec<u64>, ApiError> {
    let found = ids.iter().filter(|&&t| t == placeholder).count();
    if found != ranges.len() {
        return Err(ApiError::bad(format!(
            "the prompt has {found} media placeholders for {} media items (do not write the model's media tags in text)",
            ranges.len()
        )));
    }
    let extra: usize = ranges.iter().map(|r| r.1 as usize).sum();
    let mut out = Vec::with_capacity(ids.len() + extra);
    let mut next = ranges.iter();
    for &t in ids {
        if t == placeholder {
            let &(start, n) = next.next().expect("counted above");
            out.extend(start..start + u64::from(n));
        } else {
            out.push(u64::from(t));
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expansion() {
        let ids = [1, 9, 5, 9];
        assert_eq!(expand(&ids, 9, &[(100, 2), (200, 1)]).unwrap(), vec![1, 100, 101, 5, 200]);
        assert!(expand(&ids, 9, &[(100, 2)]).is_err());
    }
}

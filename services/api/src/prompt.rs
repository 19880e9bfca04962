//! From OpenAI messages to prompt ids: messages in transformers' form, the chat
//! template, the tokenizer, and each media placeholder (`<image>`, `<|AUDIO|>`)
//! expanded to its item's virtual token-id range.

use mmserve_text::{ChatTemplate, TextTokenizer};
use serde_json::{Value, json};

use crate::error::ApiError;
use crate::openai::{AudioSource, Content, Message, Part, parse_part};
use crate::tools::calls_for_template;

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

/// How special tokens' spellings in the messages' text are read (`--special-tokens-in-content`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum SpecialTokens {
    /// As special tokens, as transformers and vLLM do: `</s>` typed by a client ends a
    /// turn, and a typed media tag (`<image>`) is a placeholder without an item (400).
    Parse,
    /// As plain text, every special token alike: closes the prompt-injection path of
    /// clients writing the template's control tokens.
    Text,
}

/// Marks where a client's text lies in the rendered prompt, so that it can be read as
/// plain text (private-use characters and a per-process nonce: a client cannot forge them).
pub struct LiteralMarks {
    open: String,
    close: String,
}

impl LiteralMarks {
    pub fn new(nonce: u64) -> Self {
        LiteralMarks { open: format!("\u{E000}{nonce:016x}\u{E001}"), close: format!("\u{E002}{nonce:016x}\u{E003}") }
    }

    fn wrap(&self, text: &str) -> String {
        format!("{}{text}{}", self.open, self.close)
    }

    /// The rendered prompt's pieces: (text, whether it is a client's text to read literally).
    fn split<'a>(&self, mut rendered: &'a str) -> Result<Vec<(&'a str, bool)>, ApiError> {
        let mut pieces = Vec::new();
        while let Some(start) = rendered.find(&self.open) {
            pieces.push((&rendered[..start], false));
            let rest = &rendered[start + self.open.len()..];
            let end = rest.find(&self.close).ok_or_else(|| {
                ApiError::Internal(
                    "the chat template cut a message's text apart; it cannot be read as plain text".into(),
                )
            })?;
            pieces.push((&rest[..end], true));
            rendered = &rest[end + self.close.len()..];
        }
        pieces.push((rendered, false));
        Ok(pieces)
    }
}

/// Marks the messages' text parts that hold a special token's spelling, so that they are
/// read literally; other text is tokenized with the whole prompt, exactly as transformers
/// does. (Runs on the CPU pool: it scans all the text.)
pub fn mark_literal(messages: &mut Value, marks: &LiteralMarks, tokenizer: &TextTokenizer) {
    let Some(messages) = messages.as_array_mut() else { return };
    for m in messages {
        let Some(parts) = m.get_mut("content").and_then(Value::as_array_mut) else { continue };
        for p in parts {
            if let Some(Value::String(t)) = p.get_mut("text")
                && tokenizer.find_special(t).is_some()
            {
                *t = marks.wrap(t);
            }
        }
    }
}

pub fn parse_messages(messages: &[Message]) -> Result<ParsedMessages, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::bad_param("messages", "`messages` must not be empty"));
    }
    let mut out = Vec::with_capacity(messages.len());
    let mut items = Vec::new();
    let mut text_bytes = 0usize;
    for (i, m) in messages.iter().enumerate() {
        if !matches!(m.role.as_str(), "system" | "user" | "assistant" | "developer" | "tool") {
            return Err(ApiError::bad_param("messages", format!("messages[{i}]: unsupported role {:?}", m.role)));
        }
        let at = format!("messages[{i}]");
        let calls = match (&m.tool_calls, m.role.as_str()) {
            (None, _) => None,
            (Some(Value::Null), _) => None,
            (Some(c), "assistant") => Some(calls_for_template(c, &at).map_err(|e| ApiError::bad_param("messages", e))?),
            (Some(_), _) => {
                return Err(ApiError::bad_param("messages", format!("{at}: only assistant messages have tool_calls")));
            }
        };
        if m.role == "tool" && m.tool_call_id.is_none() {
            return Err(ApiError::bad_param("messages", format!("{at}: a tool message needs `tool_call_id`")));
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
        let mut message = json!({"role": m.role, "content": parts});
        if let Some(calls) = calls {
            message["tool_calls"] = calls;
        }
        if let Some(id) = &m.tool_call_id {
            message["tool_call_id"] = json!(id);
        }
        if let Some(name) = &m.name {
            message["name"] = json!(name);
        }
        out.push(message);
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

/// Renders and tokenizes; returns the ids with placeholders still in place. With
/// `marks`, marked text is read as plain text.
pub fn tokenize(
    template: &ChatTemplate,
    tokenizer: &TextTokenizer,
    messages: &Value,
    tools: Option<&Value>,
    marks: Option<&LiteralMarks>,
    add_generation_prompt: bool,
) -> Result<Vec<u32>, ApiError> {
    let text = template.render(messages, tools, add_generation_prompt).map_err(|e| ApiError::bad(e.to_string()))?;
    let pieces = match marks {
        Some(m) => m.split(&text)?,
        None => vec![(text.as_str(), false)],
    };
    tokenizer.encode_prompt_pieces(&pieces).map_err(|e| ApiError::Internal(e.to_string()))
}

/// Replaces the n-th placeholder with the n-th range.
pub fn expand(ids: &[u32], placeholder: u32, ranges: &[(u64, u32)]) -> Result<Vec<u64>, ApiError> {
    let found = ids.iter().filter(|&&t| t == placeholder).count();
    if found != ranges.len() {
        return Err(ApiError::bad(format!(
            "the prompt has {found} media placeholders for {} media items (the model's media tags written in text are placeholders unless the server reads text literally: --special-tokens-in-content text)",
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

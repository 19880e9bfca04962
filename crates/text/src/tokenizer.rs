//! `tokenizer.json` through the `tokenizers` crate, with the special tokens that
//! `tokenizer_config.json` and `generation_config.json` name.

use std::collections::HashSet;

use mmserve_config::ModelDir;
use serde_json::Value;
use tokenizers::Tokenizer;

use crate::TextError;

pub struct TextTokenizer {
    inner: Tokenizer,
    bos_token: Option<String>,
    eos_token: Option<String>,
    eos_ids: Vec<u32>,
    special_ids: HashSet<u32>,
    max_token_bytes: usize,
}

/// A special token in `tokenizer_config.json`: a string or `{"content": …}`.
fn token_string(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

impl TextTokenizer {
    pub fn from_dir(dir: &ModelDir) -> Result<Self, TextError> {
        let path = dir.path("tokenizer.json");
        let inner = Tokenizer::from_file(&path).map_err(|e| TextError::Tokenizer { path, message: e.to_string() })?;
        let tc = dir.optional_json("tokenizer_config.json")?;
        let gc = dir.optional_json("generation_config.json")?;
        Ok(Self::from_parts(inner, tc, gc))
    }

    /// From the contents of `tokenizer.json`, `tokenizer_config.json` and
    /// `generation_config.json` (for tokenizers that come without a model directory).
    pub fn from_bytes(
        tokenizer_json: &[u8],
        tokenizer_config: Option<Value>,
        generation_config: Option<Value>,
    ) -> Result<Self, TextError> {
        let inner = Tokenizer::from_bytes(tokenizer_json)
            .map_err(|e| TextError::Tokenizer { path: "tokenizer.json".into(), message: e.to_string() })?;
        Ok(Self::from_parts(inner, tokenizer_config, generation_config))
    }

    fn from_parts(inner: Tokenizer, tc: Option<Value>, gc: Option<Value>) -> Self {
        let tc = tc.unwrap_or(Value::Null);
        let bos_token = token_string(tc.get("bos_token"));
        let eos_token = token_string(tc.get("eos_token"));
        let mut eos_ids = Vec::new();
        if let Some(gc) = gc {
            match gc.get("eos_token_id") {
                Some(Value::Number(n)) => eos_ids.extend(n.as_u64().map(|n| n as u32)),
                Some(Value::Array(a)) => eos_ids.extend(a.iter().filter_map(Value::as_u64).map(|n| n as u32)),
                _ => {}
            }
        }
        if let Some(id) = eos_token.as_deref().and_then(|t| inner.token_to_id(t))
            && !eos_ids.contains(&id)
        {
            eos_ids.push(id);
        }
        let special_ids =
            inner.get_added_tokens_decoder().iter().filter(|(_, t)| t.special).map(|(id, _)| *id).collect();
        // UTF-8 bytes of the longest vocabulary entry: no token stands for more text
        // (byte-level and SentencePiece spellings take at least as many bytes as the
        // text they stand for).
        let max_token_bytes = inner.get_vocab(true).keys().map(String::len).max().unwrap_or(1).max(1);
        TextTokenizer { inner, bos_token, eos_token, eos_ids, special_ids, max_token_bytes }
    }

    /// Most bytes of text one token stands for: `text.len() / max_token_bytes()` tokens
    /// at least, whatever the text (up to what normalisation removes).
    pub fn max_token_bytes(&self) -> usize {
        self.max_token_bytes
    }

    /// Tokenizes a rendered chat prompt. The tokenizer's post-processor adds BOS unless
    /// the template already wrote it (templates differ on this).
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let add_special = !self.bos_token.as_deref().is_some_and(|b| !b.is_empty() && text.starts_with(b));
        // No offsets: they would cost more memory than the ids (a prompt's encoding is
        // many times its text's size).
        let enc = self.inner.encode_fast(text, add_special).map_err(|e| TextError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> String {
        // Ids past the tokenizer (padded vocabulary rows) decode to nothing, as in transformers.
        let known: Vec<u32> = ids.iter().copied().filter(|&id| (id as usize) < self.vocab_len()).collect();
        self.inner.decode(&known, skip_special_tokens).unwrap_or_default()
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// The token's string in the vocabulary (for byte-level BPE, one character per byte).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// Tokens the tokenizer knows, added tokens included.
    pub fn vocab_len(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn eos_ids(&self) -> &[u32] {
        &self.eos_ids
    }

    pub fn is_special(&self, id: u32) -> bool {
        self.special_ids.contains(&id)
    }

    pub fn bos_token(&self) -> Option<&str> {
        self.bos_token.as_deref()
    }

    pub fn eos_token(&self) -> Option<&str> {
        self.eos_token.as_deref()
    }
}

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
    /// The special tokens' spellings, longest first.
    special_strings: Vec<String>,
    /// The same tokenizer reading special tokens' spellings as plain text (made on first use).
    literal: std::sync::OnceLock<Tokenizer>,
    /// What the post-processor puts before and after a sequence (BOS, for one).
    wrap: (Vec<u32>, Vec<u32>),
}

/// The ids the post-processor adds before and after one sequence, found by encoding a
/// probe text with and without it.
fn post_processor_wrap(inner: &Tokenizer) -> (Vec<u32>, Vec<u32>) {
    let ids = |add| inner.encode_fast("a", add).map(|e| e.get_ids().to_vec()).unwrap_or_default();
    let (with, without) = (ids(true), ids(false));
    match (0..=with.len().saturating_sub(without.len())).find(|&i| with[i..].starts_with(&without)) {
        Some(i) if !without.is_empty() => (with[..i].to_vec(), with[i + without.len()..].to_vec()),
        _ => (Vec::new(), Vec::new()),
    }
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
        let added = inner.get_added_tokens_decoder();
        let special_ids = added.iter().filter(|(_, t)| t.special).map(|(id, _)| *id).collect();
        let mut special_strings: Vec<String> =
            added.values().filter(|t| t.special && !t.content.is_empty()).map(|t| t.content.clone()).collect();
        special_strings.sort_by_key(|s| std::cmp::Reverse(s.len()));
        let wrap = post_processor_wrap(&inner);
        // UTF-8 bytes of the longest vocabulary entry: no token stands for more text
        // (byte-level and SentencePiece spellings take at least as many bytes as the
        // text they stand for).
        let max_token_bytes = inner.get_vocab(true).keys().map(String::len).max().unwrap_or(1).max(1);
        TextTokenizer {
            inner,
            bos_token,
            eos_token,
            eos_ids,
            special_ids,
            max_token_bytes,
            special_strings,
            literal: Default::default(),
            wrap,
        }
    }

    /// The first special token's spelling found in `text`, if any.
    pub fn find_special<'a>(&'a self, text: &str) -> Option<&'a str> {
        self.special_strings.iter().find(|s| text.contains(s.as_str())).map(String::as_str)
    }

    /// Tokenizes a rendered prompt made of pieces: template text, whose special tokens'
    /// spellings are special tokens, and `literal` pieces (text from a client read as
    /// plain text: a `</s>` typed there is the characters, not the token). Each literal
    /// piece is tokenized on its own, so the tokens at its edges may differ from those
    /// of the whole prompt read as one text.
    pub fn encode_prompt_pieces(&self, pieces: &[(&str, bool)]) -> Result<Vec<u32>, TextError> {
        if let [(text, false)] = pieces {
            return self.encode_prompt(text);
        }
        let first = pieces.first().map_or("", |p| p.0);
        let add_special = !self.bos_token.as_deref().is_some_and(|b| !b.is_empty() && first.starts_with(b));
        let literal = self.literal.get_or_init(|| {
            let mut t = self.inner.clone();
            t.set_encode_special_tokens(true);
            t
        });
        let mut ids = Vec::new();
        if add_special {
            ids.extend_from_slice(&self.wrap.0);
        }
        for &(text, is_literal) in pieces.iter().filter(|p| !p.0.is_empty()) {
            let tok = if is_literal { literal } else { &self.inner };
            let enc = tok.encode_fast(text, false).map_err(|e| TextError::Encode(e.to_string()))?;
            ids.extend_from_slice(enc.get_ids());
        }
        if add_special {
            ids.extend_from_slice(&self.wrap.1);
        }
        Ok(ids)
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

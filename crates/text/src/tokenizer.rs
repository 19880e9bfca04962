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
    /// Finds the special tokens' spellings in a text (none if there are none).
    special_finder: Option<aho_corasick::AhoCorasick>,
    /// The tokenizers [`Self::encode_prompt_pieces`] uses (made on first use).
    variants: std::sync::OnceLock<Variants>,
    /// What the post-processor puts before and after a sequence (BOS, for one).
    wrap: (Vec<u32>, Vec<u32>),
}

/// The tokenizer reading special tokens' spellings as plain text, and both it and the
/// plain one for text that continues a prompt (no prefix space added at its start).
struct Variants {
    literal: Tokenizer,
    continuing: Tokenizer,
    literal_continuing: Tokenizer,
}

impl Variants {
    fn of(inner: &Tokenizer) -> Self {
        let mut literal = inner.clone();
        literal.set_encode_special_tokens(true);
        let (continuing, literal_continuing) = (continuing(inner), continuing(&literal));
        Variants { literal, continuing, literal_continuing }
    }
}

/// `t` without what it adds at the start of a text: the prefix space of a Metaspace or
/// byte-level pre-tokenizer, a `Prepend` normaliser.
fn continuing(t: &Tokenizer) -> Tokenizer {
    use tokenizers::{NormalizerWrapper, PreTokenizerWrapper};
    fn pre(p: &PreTokenizerWrapper) -> PreTokenizerWrapper {
        match p {
            PreTokenizerWrapper::Metaspace(m) => {
                let mut m = m.clone();
                m.set_prepend_scheme(tokenizers::pre_tokenizers::metaspace::PrependScheme::Never);
                PreTokenizerWrapper::Metaspace(m)
            }
            PreTokenizerWrapper::ByteLevel(b) => {
                let mut b = *b;
                b.add_prefix_space = false;
                PreTokenizerWrapper::ByteLevel(b)
            }
            PreTokenizerWrapper::Sequence(s) => PreTokenizerWrapper::Sequence(
                tokenizers::pre_tokenizers::sequence::Sequence::new(s.as_ref().iter().map(pre).collect()),
            ),
            other => other.clone(),
        }
    }
    fn norm(n: &NormalizerWrapper) -> Option<NormalizerWrapper> {
        match n {
            NormalizerWrapper::Prepend(_) => None,
            NormalizerWrapper::Sequence(s) => Some(NormalizerWrapper::Sequence(
                tokenizers::normalizers::Sequence::new(s.as_ref().iter().filter_map(norm).collect()),
            )),
            other => Some(other.clone()),
        }
    }
    let mut out = t.clone();
    if let Some(p) = t.get_pre_tokenizer() {
        out.with_pre_tokenizer(Some(pre(p)));
    }
    if let Some(n) = t.get_normalizer() {
        let _ = out.with_normalizer(norm(n));
    }
    out
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
        let special_strings: Vec<&str> =
            added.values().filter(|t| t.special && !t.content.is_empty()).map(|t| t.content.as_str()).collect();
        let special_finder =
            (!special_strings.is_empty()).then(|| aho_corasick::AhoCorasick::new(&special_strings).ok()).flatten();
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
            special_finder,
            variants: Default::default(),
            wrap,
        }
    }

    /// Where the first special token's spelling in `text` is, if any (one pass over the
    /// text, however many special tokens there are).
    pub fn find_special(&self, text: &str) -> Option<std::ops::Range<usize>> {
        self.special_finder.as_ref()?.find(text).map(|m| m.range())
    }

    /// Tokenizes a rendered prompt made of pieces: template text, whose special tokens'
    /// spellings are special tokens, and `literal` pieces (text from a client read as
    /// plain text: a `</s>` typed there is the characters, not the token). Each piece is
    /// tokenized on its own, pieces after the first without the prefix space that
    /// SentencePiece-style tokenizers put at the start of a text, and a space ending a
    /// piece moved to the next, so that a prompt cut at word boundaries gives the tokens
    /// of the whole; within a word, the tokens at a cut may differ.
    pub fn encode_prompt_pieces(&self, pieces: &[(&str, bool)]) -> Result<Vec<u32>, TextError> {
        if let [(text, false)] = pieces {
            return self.encode_prompt(text);
        }
        let first = pieces.first().map_or("", |p| p.0);
        let add_special = !self.bos_token.as_deref().is_some_and(|b| !b.is_empty() && first.starts_with(b));
        let v = self.variants.get_or_init(|| Variants::of(&self.inner));
        // A space ending a piece belongs to the next word (both SentencePiece and
        // byte-level pre-tokenizers attach one space to the word after it): move it there.
        let mut pieces: Vec<(String, bool)> = pieces.iter().map(|&(t, l)| (t.to_string(), l)).collect();
        for i in 1..pieces.len() {
            if pieces[i - 1].0.ends_with(' ') && !pieces[i].0.is_empty() {
                pieces[i - 1].0.pop();
                pieces[i].0.insert(0, ' ');
            }
        }
        let mut ids = Vec::new();
        if add_special {
            ids.extend_from_slice(&self.wrap.0);
        }
        for (i, (text, is_literal)) in pieces.iter().enumerate().filter(|(_, p)| !p.0.is_empty()) {
            let (text, is_literal) = (text.as_str(), *is_literal);
            let tok = match (i == 0, is_literal) {
                (true, false) => &self.inner,
                (true, true) => &v.literal,
                (false, false) => &v.continuing,
                (false, true) => &v.literal_continuing,
            };
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

    /// Tokenizes `text` as text continuing a sequence: no special tokens, and none of the
    /// prefix space a pre-tokenizer puts at the start of a text (a grammar's bytes, which
    /// follow earlier output).
    pub fn encode_continuing(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let v = self.variants.get_or_init(|| Variants::of(&self.inner));
        let enc = v.continuing.encode_fast(text, false).map_err(|e| TextError::Encode(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    /// Tokenizes `text` as is, adding no special tokens (`/tokenize` without them).
    pub fn encode_plain(&self, text: &str) -> Result<Vec<u32>, TextError> {
        let enc = self.inner.encode_fast(text, false).map_err(|e| TextError::Encode(e.to_string()))?;
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

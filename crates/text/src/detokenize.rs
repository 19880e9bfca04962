//! Incremental detokenization.
//!
//! Decoding tokens one at a time breaks words that span tokens (leading spaces,
//! byte-fallback pieces of one UTF-8 character). So the decoder keeps a window: it
//! decodes the tokens since the last emitted boundary with and without the newest ones,
//! and emits the difference only once it no longer ends in U+FFFD (an incomplete
//! character).

use crate::TextTokenizer;

#[derive(Debug, Default)]
pub struct IncrementalDecoder {
    ids: Vec<u32>,
    /// Start of the context window (already emitted, kept for spacing).
    prefix_offset: usize,
    /// Tokens before this have been emitted.
    read_offset: usize,
    skip_special_tokens: bool,
}

impl IncrementalDecoder {
    pub fn new(skip_special_tokens: bool) -> Self {
        IncrementalDecoder { skip_special_tokens, ..Default::default() }
    }

    /// Adds a token; returns the text it completes (possibly empty).
    pub fn push(&mut self, tokenizer: &TextTokenizer, id: u32) -> String {
        self.ids.push(id);
        let (emitted, full) = self.window(tokenizer);
        if full.ends_with('\u{FFFD}') || full.len() <= emitted.len() {
            return String::new();
        }
        let delta = match full.strip_prefix(emitted.as_str()) {
            Some(d) => d.to_string(),
            // The newest token changed earlier text (rare normalisations): emit the new tail.
            None => full.chars().skip(emitted.chars().count()).collect(),
        };
        self.prefix_offset = self.read_offset;
        self.read_offset = self.ids.len();
        delta
    }

    /// Text still held back at the end (an incomplete character becomes U+FFFD).
    pub fn finish(&mut self, tokenizer: &TextTokenizer) -> String {
        if self.read_offset == self.ids.len() {
            return String::new();
        }
        let (emitted, full) = self.window(tokenizer);
        self.read_offset = self.ids.len();
        full.strip_prefix(emitted.as_str()).map(str::to_string).unwrap_or_default()
    }

    fn window(&self, tokenizer: &TextTokenizer) -> (String, String) {
        let emitted = tokenizer.decode(&self.ids[self.prefix_offset..self.read_offset], self.skip_special_tokens);
        let full = tokenizer.decode(&self.ids[self.prefix_offset..], self.skip_special_tokens);
        (emitted, full)
    }
}

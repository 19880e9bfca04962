//! Constrained decoding (structured outputs): a [`Constraint`] (a JSON schema, any JSON
//! object, a regex, a choice of strings, a Lark grammar) becomes, for each step of a
//! sequence, the set of tokens that keep the output on the grammar: a bitmask over the
//! vocabulary. The grammar engine is `llguidance` (what vLLM and SGLang call into), over a
//! token trie built from the model's own `tokenizer.json` (each token's bytes, special
//! tokens marked), tokenizing through our tokenizer.
//!
//! [`Grammars`] compiles each distinct constraint once (a bounded cache); a sequence gets
//! its own [`Matcher`], a copy of the compiled one, which computes masks and follows the
//! sampled tokens.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use llguidance::ParserFactory;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use mmserve_config::ModelDir;
use mmserve_protocol::Constraint;
use mmserve_text::TextTokenizer;

#[derive(Debug, Clone, thiserror::Error)]
pub enum GrammarError {
    /// The constraint itself is wrong (a bad schema, regex or grammar): the client's fault.
    #[error("{0}")]
    Invalid(String),
    /// The tokenizer could not be read into a token trie.
    #[error("reading the tokenizer for structured outputs: {0}")]
    Tokenizer(String),
    /// The grammar engine failed while following a sequence.
    #[error("structured output: {0}")]
    Matcher(String),
}

/// The most compiled constraints kept (each a parser with its lexer tables).
const CACHE: usize = 64;

/// The tokenizer as the grammar engine sees it: a trie of each token's bytes.
struct Env {
    trie: TokTrie,
    tokenizer: TextTokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        // Bytes the grammar forces continue the output: no prefix space. Grammar lexemes
        // are text; bytes that are not UTF-8 cannot come from it.
        self.tokenizer.encode_continuing(&String::from_utf8_lossy(s)).unwrap_or_default()
    }
}

/// The compiler and cache of one model's constraints.
pub struct Grammars {
    factory: ParserFactory,
    /// Compiled matchers by constraint, most recent last.
    cache: Mutex<VecDeque<(Constraint, llguidance::Matcher)>>,
    vocab: usize,
}

impl Grammars {
    /// For the model in `dir` (its `tokenizer.json`), whose end-of-sequence token is
    /// `eos` (what a constraint allows once the output is complete).
    pub fn new(dir: &ModelDir, eos: u32) -> Result<Self, GrammarError> {
        let text = std::fs::read_to_string(dir.path("tokenizer.json"))
            .map_err(|e| GrammarError::Tokenizer(format!("tokenizer.json: {e}")))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| GrammarError::Tokenizer(format!("tokenizer.json: {e}")))?;
        let words =
            llguidance::token_bytes_from_tokenizer_json(&json).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        let tokenizer = TextTokenizer::from_dir(dir).map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        let vocab = words.len();
        let trie = TokTrie::from(&TokRxInfo::new(vocab as u32, eos), &words);
        let env: TokEnv = Arc::new(Env { trie, tokenizer });
        let mut factory = ParserFactory::new(&env, InferenceCapabilities::default(), &[])
            .map_err(|e| GrammarError::Tokenizer(e.to_string()))?;
        factory.quiet();
        Ok(Grammars { factory, cache: Mutex::new(VecDeque::new()), vocab })
    }

    /// Tokens the trie knows (the mask's length); logits past it are never allowed.
    pub fn vocab(&self) -> usize {
        self.vocab
    }

    /// A matcher for `c` at the start of an output; `Invalid` says what is wrong with it.
    pub fn matcher(&self, c: &Constraint) -> Result<Matcher, GrammarError> {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(i) = cache.iter().position(|(k, _)| k == c) {
            let entry = cache.remove(i).expect("found");
            let copy = entry.1.deep_clone();
            cache.push_back(entry);
            return Ok(Matcher { inner: copy, vocab: self.vocab });
        }
        drop(cache);
        let parser = self.factory.create_parser(grammar(c)?).map_err(|e| GrammarError::Invalid(e.to_string()))?;
        let compiled = llguidance::Matcher::new(Ok(parser));
        if let Some(e) = compiled.get_error() {
            return Err(GrammarError::Invalid(e));
        }
        let copy = compiled.deep_clone();
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        cache.push_back((c.clone(), compiled));
        if cache.len() > CACHE {
            cache.pop_front();
        }
        Ok(Matcher { inner: copy, vocab: self.vocab })
    }
}

/// The grammar of a constraint, for llguidance.
fn grammar(c: &Constraint) -> Result<TopLevelGrammar, GrammarError> {
    let invalid = |what: &str, e: &dyn std::fmt::Display| GrammarError::Invalid(format!("{what}: {e}"));
    Ok(match c {
        Constraint::JsonSchema(text) => {
            let schema: serde_json::Value = serde_json::from_str(text).map_err(|e| invalid("the JSON schema", &e))?;
            if !schema.is_object() {
                return Err(GrammarError::Invalid("the JSON schema must be an object".into()));
            }
            TopLevelGrammar::from_json_schema(compact(schema))
        }
        Constraint::JsonObject => TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"}))),
        Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
        Constraint::Choice(options) => {
            if options.is_empty() {
                return Err(GrammarError::Invalid("a choice needs at least one option".into()));
            }
            let alternatives: Vec<String> = options.iter().map(|o| regex_literal(o)).collect();
            TopLevelGrammar::from_regex(&alternatives.join("|"))
        }
        Constraint::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
    })
}

/// `schema` written as `json.dumps` writes (`", "` and `": "`, no other whitespace)
/// unless it says otherwise (llguidance's `x-guidance`): free whitespace lets a weak or
/// unlucky model pad forever without breaking the grammar.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = schema.as_object_mut()
        && !obj.contains_key("x-guidance")
    {
        obj.insert(
            "x-guidance".into(),
            serde_json::json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
        );
    }
    schema
}

/// `s` as a regex that matches exactly it.
fn regex_literal(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('(');
    for ch in s.chars() {
        if "\\.+*?()|[]{}^$".contains(ch) {
            out.push('\\');
        }
        out.push(ch);
    }
    out.push(')');
    out
}

/// One sequence's place in its constraint.
pub struct Matcher {
    inner: llguidance::Matcher,
    vocab: usize,
}

impl Clone for Matcher {
    /// An independent copy at the same place (a fork of the sequence).
    fn clone(&self) -> Self {
        Matcher { inner: self.inner.deep_clone(), vocab: self.vocab }
    }
}

impl std::fmt::Debug for Matcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Matcher").field("vocab", &self.vocab).field("stopped", &self.inner.is_stopped()).finish()
    }
}

impl Matcher {
    /// The tokens allowed next, as bits (token t is bit t % 32 of word t / 32), over the
    /// trie's vocabulary; when the output is complete, only the end-of-sequence token.
    /// `mmserve_ops::token_mask` applies it, on the host or where the logits are.
    pub fn mask(&mut self) -> Result<Vec<u32>, GrammarError> {
        let vob = self.inner.compute_mask_or_eos().map_err(|e| GrammarError::Matcher(e.to_string()))?;
        Ok(vob.as_slice().to_vec())
    }

    /// Follows the sampled `token`. Returns whether the output is complete (nothing but
    /// the end may follow).
    pub fn advance(&mut self, token: u32) -> Result<bool, GrammarError> {
        if (token as usize) < self.vocab {
            self.inner.consume_token(token).map_err(|e| GrammarError::Matcher(e.to_string()))?;
        }
        Ok(self.inner.is_stopped())
    }

    /// Whether the output so far is a complete match.
    pub fn is_accepting(&mut self) -> bool {
        self.inner.is_accepting().unwrap_or(false)
    }
}

//! Constraints followed through the real tokenizers of the fixtures: random "models"
//! (seeded random logits) under a mask always produce output that parses and matches.

use mmserve_config::ModelDir;
use mmserve_grammar::{GrammarError, Grammars, Matcher};
use mmserve_protocol::Constraint;
use mmserve_text::TextTokenizer;

fn repo() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// (grammars, tokenizer, EOS) of a fixture.
fn setup(model: &str) -> (Grammars, TextTokenizer, u32) {
    let dir = ModelDir::open(repo().join("assets/models").join(model)).unwrap();
    let tok = TextTokenizer::from_dir(&dir).unwrap();
    let eos = tok.eos_ids()[0];
    (Grammars::new(&dir, eos).unwrap(), tok, eos)
}

/// Decodes under `m` with seeded random logits over `vocab` rows until the end.
fn run(m: &mut Matcher, vocab: usize, eos: u32, seed: u64) -> Vec<u32> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut out = Vec::new();
    for _ in 0..400 {
        let mut logits: Vec<f32> = (0..vocab)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                (state >> 40) as f32 / (1u64 << 24) as f32 * 8.0
            })
            .collect();
        let mask = m.mask().unwrap();
        for (t, l) in logits.iter_mut().enumerate() {
            if mask.get(t / 32).is_none_or(|w| w >> (t % 32) & 1 == 0) {
                *l = f32::NEG_INFINITY;
            }
        }
        let token = (0..vocab).max_by(|&a, &b| logits[a].total_cmp(&logits[b]).then(b.cmp(&a))).unwrap() as u32;
        assert!(logits[token as usize].is_finite(), "the mask allowed nothing");
        if token == eos {
            return out;
        }
        out.push(token);
        if m.advance(token).unwrap() {
            return out;
        }
    }
    panic!("no end after 400 tokens: {out:?}");
}

#[test]
fn seeded_random_outputs_parse_and_match_the_schema() {
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "tags": {"type": "array", "items": {"enum": ["red", "blue"]}, "maxItems": 3},
            "address": {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                        "required": ["zip"], "additionalProperties": false}
        },
        "required": ["name", "age", "tags", "address"],
        "additionalProperties": false
    });
    for model in ["llava-tiny", "qwen2-vl-tiny"] {
        let (grammars, tok, eos) = setup(model);
        let c = Constraint::JsonSchema(schema.to_string());
        for seed in 0..20 {
            let mut m = grammars.matcher(&c).unwrap();
            let ids = run(&mut m, grammars.vocab() + 3, eos, seed);
            let text = tok.decode(&ids, true);
            let v: serde_json::Value =
                serde_json::from_str(&text).unwrap_or_else(|e| panic!("{model} seed {seed}: {e}: {text:?}"));
            assert!(v["name"].as_str().unwrap().chars().count() <= 6, "{text}");
            assert!((0..=120).contains(&v["age"].as_i64().unwrap()), "{text}");
            let tags = v["tags"].as_array().unwrap();
            assert!(tags.len() <= 3 && tags.iter().all(|t| t == "red" || t == "blue"), "{text}");
            let zip = v["address"]["zip"].as_str().unwrap();
            assert!(zip.len() == 5 && zip.chars().all(|c| c.is_ascii_digit()), "{text}");
            assert_eq!(v.as_object().unwrap().len(), 4, "{text}");
        }
    }
}

#[test]
fn regexes_and_choices_constrain_exactly() {
    let (grammars, tok, eos) = setup("llava-tiny");
    for seed in 0..10 {
        let mut m = grammars.matcher(&Constraint::Regex(r"[0-9]{3}-[a-z]{2}".into())).unwrap();
        let text = tok.decode(&run(&mut m, grammars.vocab(), eos, seed), true);
        let b = text.as_bytes();
        assert!(b.len() == 6 && b[..3].iter().all(u8::is_ascii_digit) && b[3] == b'-', "{text:?}");
        let options = vec!["yes".to_string(), "no".to_string(), "a (b)?".to_string()];
        let mut m = grammars.matcher(&Constraint::Choice(options.clone())).unwrap();
        let text = tok.decode(&run(&mut m, grammars.vocab(), eos, seed), true);
        assert!(options.contains(&text), "{text:?}");
    }
    // Any object: random logits would write keys forever, so the first steps only.
    let mut m = grammars.matcher(&Constraint::JsonObject).unwrap();
    let mask = m.mask().unwrap();
    let allowed: Vec<u32> =
        (0..grammars.vocab() as u32).filter(|&t| mask[t as usize / 32] >> (t % 32) & 1 == 1).collect();
    assert!(!allowed.is_empty() && allowed.iter().all(|&t| tok.decode(&[t], false).trim_start().starts_with('{')));
}

#[test]
fn bad_constraints_are_invalid_with_a_reason() {
    let (grammars, _, _) = setup("llava-tiny");
    for c in [
        Constraint::JsonSchema("{not json".into()),
        Constraint::JsonSchema(r#"{"type": "nonsense"}"#.into()),
        Constraint::Regex("(unclosed".into()),
        Constraint::Lark("start: undefined_rule".into()),
        Constraint::Choice(Vec::new()),
    ] {
        match grammars.matcher(&c) {
            Err(GrammarError::Invalid(why)) => assert!(!why.is_empty()),
            Err(other) => panic!("{c:?}: {other}"),
            Ok(_) => panic!("{c:?} compiled"),
        }
    }
}

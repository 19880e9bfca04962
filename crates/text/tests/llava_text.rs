//! The tiny LLaVA fixture's text side against transformers' reference.

use mmserve_config::ModelDir;
use mmserve_text::{ChatTemplate, IncrementalDecoder, TextTokenizer};
use serde_json::{Value, json};

fn fixture() -> (ModelDir, Value) {
    let dir = ModelDir::open(concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/models/llava-tiny")).unwrap();
    let reference: Value = serde_json::from_str(&std::fs::read_to_string(dir.path("reference.json")).unwrap()).unwrap();
    (dir, reference)
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

#[test]
fn template_and_tokenizer_match_transformers() {
    let (dir, reference) = fixture();
    let tok = TextTokenizer::from_dir(&dir).unwrap();
    let template = ChatTemplate::new(dir.chat_template().unwrap().unwrap(), &tok).unwrap();
    let prompt = template.render(&reference["messages"], None, true).unwrap();
    assert_eq!(prompt, reference["prompt"].as_str().unwrap());
    assert_eq!(tok.encode_prompt(&prompt).unwrap(), ids(&reference["prompt_ids_before_expansion"]));

    let text_only = json!([{"role": "user", "content": [{"type": "text", "text": "Hello, how are you?"}]}]);
    let prompt = template.render(&text_only, None, true).unwrap();
    assert_eq!(prompt, reference["text_only_prompt"].as_str().unwrap());
    assert_eq!(tok.encode_prompt(&prompt).unwrap(), ids(&reference["text_only_input_ids"]));
    assert_eq!(tok.eos_ids(), &[2]);
}

#[test]
fn incremental_decoding_equals_full_decoding() {
    let (dir, reference) = fixture();
    let tok = TextTokenizer::from_dir(&dir).unwrap();
    let generated = ids(&reference["generated_ids"]);
    let mut dec = IncrementalDecoder::new(true);
    let mut text: String = generated.iter().map(|&id| dec.push(&tok, id)).collect();
    text.push_str(&dec.finish(&tok));
    assert_eq!(text, reference["generated_text"].as_str().unwrap());
}

#[test]
fn multibyte_characters_are_never_split() {
    let (dir, _) = fixture();
    let tok = TextTokenizer::from_dir(&dir).unwrap();
    let s = "naïve 🙂 ok";
    let encoded = tok.encode_prompt(s).unwrap();
    // Byte-fallback pieces: the emoji is several tokens.
    assert!(encoded.len() > s.split(' ').count() + 2, "{encoded:?}");
    let mut dec = IncrementalDecoder::new(true);
    let mut out = String::new();
    for &id in &encoded {
        let piece = dec.push(&tok, id);
        assert!(!piece.contains('\u{FFFD}'), "emitted half a character: {piece:?}");
        out.push_str(&piece);
    }
    out.push_str(&dec.finish(&tok));
    assert_eq!(out, tok.decode(&encoded, true));
    assert_eq!(out, s);
}

#[test]
fn chat_template_falls_back_to_tokenizer_config() {
    let (dir, reference) = fixture();
    let tmp = std::env::temp_dir().join(format!("mmserve-text-template-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    for f in ["config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(dir.path(f), tmp.join(f)).unwrap();
    }
    let without_jinja = ModelDir::open(&tmp).unwrap();
    let source = without_jinja.chat_template().unwrap().expect("tokenizer_config.json has one");
    let tok = TextTokenizer::from_dir(&without_jinja).unwrap();
    let prompt = ChatTemplate::new(source, &tok).unwrap().render(&reference["messages"], None, true).unwrap();
    assert_eq!(prompt, reference["prompt"].as_str().unwrap());
    // A processor's chat_template.json (a map of named templates here) comes before it.
    std::fs::write(tmp.join("chat_template.json"), r#"{"chat_template": {"default": "processor {{ 1 }}"}}"#).unwrap();
    assert_eq!(ModelDir::open(&tmp).unwrap().chat_template().unwrap().as_deref(), Some("processor {{ 1 }}"));
    std::fs::remove_file(tmp.join("chat_template.json")).unwrap();
    std::fs::remove_file(tmp.join("tokenizer_config.json")).unwrap();
    assert!(ModelDir::open(&tmp).unwrap().chat_template().unwrap().is_none());
    std::fs::remove_dir_all(&tmp).unwrap();
}

/// A tokenizer whose post-processor adds BOS keeps adding it when the prompt comes in
/// pieces, and a typed `</s>` read literally is not the EOS token.
#[test]
fn literal_pieces_keep_the_post_processors_bos() {
    let (dir, _) = fixture();
    let tok = TextTokenizer::from_dir(&dir).unwrap();
    let whole = tok.encode_prompt("USER: hello ASSISTANT:").unwrap();
    let pieces = tok.encode_prompt_pieces(&[("USER: ", false), ("hello</s>", true), (" ASSISTANT:", false)]).unwrap();
    assert_eq!(pieces[0], whole[0], "BOS first, as in the one-text tokenization");
    assert_eq!(pieces.iter().filter(|&&t| t == whole[0]).count(), 1);
    let eos = tok.eos_ids()[0];
    assert!(!pieces.contains(&eos), "a typed </s> read literally is text: {pieces:?}");
    assert_eq!(
        tok.decode(&pieces, false),
        tok.decode(&tok.encode_prompt("USER: hello</s> ASSISTANT:").unwrap(), false)
    );
    // Cut at word boundaries, the pieces give the tokens of the whole.
    for cut in [
        [("USER:", false), (" hello there", true), (" ASSISTANT:", false)],
        [("USER: ", false), ("hello there ", true), ("ASSISTANT:", false)],
    ] {
        let ids = tok.encode_prompt_pieces(&cut).unwrap();
        assert_eq!(ids, tok.encode_prompt("USER: hello there ASSISTANT:").unwrap(), "{cut:?}");
    }
    assert!(tok.encode_prompt("USER: hello</s> ASSISTANT:").unwrap().contains(&eos), "parsed, it is EOS");
}

//! Stop strings on the detokenized text.
//!
//! Text that could still be the start of a stop string is held back, so a stop string
//! spanning several tokens is caught whole and never streamed in part; the text before
//! it is returned, the stop string itself is not (vLLM's default).

#[derive(Debug, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    /// Characters to hold back: the longest stop string's length minus one.
    hold_chars: usize,
    pending: String,
}

/// What one push produced.
#[derive(Debug, PartialEq, Eq)]
pub struct Matched {
    /// Text safe to emit now.
    pub text: String,
    /// A stop string was found; nothing after it is ever emitted.
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: &[String]) -> Self {
        let stops: Vec<String> = stops.iter().filter(|s| !s.is_empty()).cloned().collect();
        let hold_chars = stops.iter().map(|s| s.chars().count()).max().unwrap_or(1).saturating_sub(1);
        StopMatcher { stops, hold_chars, pending: String::new() }
    }

    /// Adds newly decoded text.
    pub fn push(&mut self, text: &str) -> Matched {
        if self.stops.is_empty() {
            return Matched { text: text.to_string(), stopped: false };
        }
        self.pending.push_str(text);
        let first = self.stops.iter().filter_map(|s| self.pending.find(s.as_str())).min();
        if let Some(at) = first {
            let text = self.pending[..at].to_string();
            self.pending.clear();
            return Matched { text, stopped: true };
        }
        // Keep the last `hold_chars` characters: they may begin a stop string.
        let keep_from = self.pending.char_indices().rev().nth(self.hold_chars.saturating_sub(1)).map_or(0, |(i, _)| i);
        let keep_from = if self.hold_chars == 0 { self.pending.len() } else { keep_from };
        let text = self.pending[..keep_from].to_string();
        self.pending.drain(..keep_from);
        Matched { text, stopped: false }
    }

    /// The generation ended for another reason: release what was held back.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut m = StopMatcher::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let mut out = String::new();
        for p in pieces {
            let r = m.push(p);
            out.push_str(&r.text);
            if r.stopped {
                return (out, true);
            }
        }
        out.push_str(&m.finish());
        (out, false)
    }

    #[test]
    fn stops_across_token_boundaries() {
        assert_eq!(run(&["END"], &["hello E", "N", "D and more"]), ("hello ".into(), true));
        assert_eq!(run(&["END"], &["hello EN", "d"]), ("hello ENd".into(), false));
        assert_eq!(run(&["\n\n", "###"], &["a\n", "\nb"]), ("a".into(), true));
        assert_eq!(run(&[], &["x", "y"]), ("xy".into(), false));
        // Multi-byte characters are held back whole.
        assert_eq!(run(&["éé"], &["caf", "é", "é!"]), ("caf".into(), true));
        assert_eq!(run(&["🙂🙃"], &["a🙂", "b"]), ("a🙂b".into(), false));
    }

    #[test]
    fn nothing_of_a_stop_string_is_streamed() {
        let mut m = StopMatcher::new(&["STOP".to_string()]);
        let mut streamed = String::new();
        for p in ["xS", "T", "O", "P"] {
            streamed.push_str(&m.push(p).text);
            assert!(!streamed.contains('S'), "streamed part of the stop string: {streamed:?}");
        }
        assert_eq!(streamed, "x");
    }
}

/// The real Qwen2.5 tokenizer streamed through the incremental decoder, then the
/// matcher, as the engine does: stop strings that start inside one token and end in
/// another, and multi-byte stop strings.
#[cfg(test)]
mod qwen2_real {
    use std::io::Read;
    use std::ops::Range;
    use std::sync::OnceLock;

    use mmserve_text::{IncrementalDecoder, TextTokenizer};
    use proptest::prelude::*;

    use super::StopMatcher;

    struct Tokenizers {
        text: TextTokenizer,
    }

    fn tokenizers() -> &'static Tokenizers {
        static TOK: OnceLock<Tokenizers> = OnceLock::new();
        TOK.get_or_init(|| {
            let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/../../assets/tokenizers/qwen2_real");
            let mut json = Vec::new();
            let gz = std::fs::File::open(format!("{dir}/tokenizer.json.gz")).unwrap();
            flate2::read::GzDecoder::new(gz).read_to_end(&mut json).unwrap();
            let config = std::fs::read(format!("{dir}/tokenizer_config.json")).unwrap();
            let config = serde_json::from_slice(&config).unwrap();
            Tokenizers { text: TextTokenizer::from_bytes(&json, Some(config), None).unwrap() }
        })
    }

    fn encode(text: &str) -> Vec<u32> {
        let ids = tokenizers().text.encode_prompt(text).unwrap();
        assert_eq!(tokenizers().text.decode(&ids, true), text, "the tokenizer does not round-trip {text:?}");
        ids
    }

    /// Each token's byte range in the text: a byte-level token spells one byte per character.
    fn spans(text: &str, ids: &[u32]) -> Vec<Range<usize>> {
        let mut at = 0;
        let spans: Vec<Range<usize>> = ids
            .iter()
            .map(|&id| {
                let len = tokenizers().text.id_to_token(id).unwrap().chars().count();
                at += len;
                at - len..at
            })
            .collect();
        assert_eq!(at, text.len(), "token lengths do not add up for {text:?}");
        spans
    }

    /// The token whose bytes include byte `at`.
    fn token_at(spans: &[Range<usize>], at: usize) -> usize {
        spans.iter().position(|r| r.contains(&at)).unwrap()
    }

    /// Checks that `stop` starts strictly inside one token of `text` and ends in a later one.
    fn assert_straddles(text: &str, ids: &[u32], stop: &str) {
        let spans = spans(text, ids);
        let at = text.find(stop).unwrap();
        let (first, last) = (token_at(&spans, at), token_at(&spans, at + stop.len() - 1));
        assert!(spans[first].start < at, "{stop:?} starts at the start of token {first} {:?}", spans[first]);
        assert!(last > first, "{stop:?} lies within token {first} {:?}", spans[first]);
    }

    /// What the engine must stream: as each token arrives, the text decoded so far reaches
    /// the last token end that is a character boundary; the first time a stop string is
    /// in it, the output is the text before the earliest such stop string, and the
    /// generation stops at that token.
    fn reference(text: &str, ids: &[u32], stops: &[&str]) -> (String, Option<usize>) {
        let mut visible = 0;
        for (k, r) in spans(text, ids).iter().enumerate() {
            if text.is_char_boundary(r.end) {
                visible = r.end;
            }
            if let Some(at) = stops.iter().filter_map(|s| text[..visible].find(s)).min() {
                return (text[..at].to_string(), Some(k));
            }
        }
        (text.to_string(), None)
    }

    /// Streams `text`'s tokens through the decoder and the matcher as `Batch` does, and
    /// checks every step against `reference`. Returns the streamed text and the token at
    /// which the stop was reported.
    fn stream(text: &str, stops: &[&str]) -> (String, Option<usize>) {
        let tok = &tokenizers().text;
        let ids = encode(text);
        let (expected, expected_step) = reference(text, &ids, stops);
        let spans = spans(text, &ids);
        let hold = stops.iter().map(|s| s.chars().count()).max().unwrap_or(1) - 1;
        let mut decoder = IncrementalDecoder::new(true);
        let mut matcher = StopMatcher::new(&stops.iter().map(|s| s.to_string()).collect::<Vec<_>>());
        let mut out = String::new();
        let mut visible = 0;
        for (k, &id) in ids.iter().enumerate() {
            let matched = matcher.push(&decoder.push(tok, id));
            out.push_str(&matched.text);
            // Nothing past the text before the stop string, ever.
            assert!(expected.starts_with(&out), "step {k}: streamed {out:?}, must stay a prefix of {expected:?}");
            if matched.stopped {
                assert_eq!(Some(k), expected_step, "stop reported at the wrong token for {stops:?} in {text:?}");
                assert_eq!(out, expected);
                return (out, Some(k));
            }
            // Nor does the matcher hold back more than the longest stop string minus one character.
            if text.is_char_boundary(spans[k].end) {
                visible = spans[k].end;
            }
            let must_have = text[..visible].char_indices().rev().nth(hold.saturating_sub(1)).map_or(0, |(i, _)| i);
            let must_have = if hold == 0 { visible } else { must_have };
            assert!(out.len() >= must_have, "step {k}: streamed only {out:?} of {:?}", &text[..visible]);
        }
        let tail = matcher.push(&decoder.finish(tok));
        out.push_str(&tail.text);
        assert!(!tail.stopped, "a stop string was found only at the end of {text:?}");
        out.push_str(&matcher.finish());
        assert_eq!(expected_step, None, "the stop in {text:?} was not reported");
        assert_eq!(out, expected);
        (out, None)
    }

    const FOX: &str = "The quick brown fox jumps over the lazy dog.";
    const CHINESE: &str = "你好世界，今天天气很好。\n明天见。\n他说：“好的。”\n然后走了";

    #[test]
    fn ascii_stop_starting_inside_a_token() {
        // " quick" and " brown" are one token each: "ick bro" starts and ends inside them.
        assert_straddles(FOX, &encode(FOX), "ick bro");
        assert_eq!(stream(FOX, &["ick bro"]), ("The qu".into(), Some(2)));
        assert_straddles(FOX, &encode(FOX), "y dog.");
        assert_eq!(stream(FOX, &["y dog."]).0, "The quick brown fox jumps over the laz");
        // A false start ("ick bri") is held back, then released.
        let text = "A quick brick, a quick brown fox";
        assert_straddles(text, &encode(text), "ick bro");
        assert_eq!(stream(text, &["ick bro"]).0, "A quick brick, a qu");
    }

    #[test]
    fn multibyte_stops_across_tokens() {
        let ids = encode(CHINESE);
        // "你好" and "世界" are one token each.
        assert_straddles(CHINESE, &ids, "好世");
        assert_eq!(stream(CHINESE, &["好世"]), ("你".into(), Some(1)));
        // "很好" then "。\n": the stop ends inside the second token.
        assert_straddles(CHINESE, &ids, "好。");
        assert_eq!(stream(CHINESE, &["好。"]).0, "你好世界，今天天气很");
        // "。”", "\n", "然后": starts inside the first, ends inside the third.
        assert_straddles(CHINESE, &ids, "”\n然");
        assert_eq!(stream(CHINESE, &["”\n然"]).0, "你好世界，今天天气很好。\n明天见。\n他说：“好的。");
        // "。\n" is a single token here; it stops at its first occurrence.
        assert_eq!(stream(CHINESE, &["。\n"]), ("你好世界，今天天气很好".into(), Some(6)));
        // The earliest of several stop strings wins ("今天" and "天气" are one token each).
        assert_straddles(CHINESE, &ids, "天天");
        assert_eq!(stream(CHINESE, &["明天", "很好。", "天天"]), ("你好世界，今".into(), Some(4)));
        // Of two stop strings completed by the same token ("天气"), the one that starts first wins.
        assert_eq!(stream(CHINESE, &["天气", "天天气"]), ("你好世界，今".into(), Some(4)));
        // The first one complete wins, even if another, still incomplete, started earlier.
        assert_eq!(stream(CHINESE, &["天天气很好", "气"]), ("你好世界，今天天".into(), Some(4)));
        // Absent stop strings hold nothing back in the end.
        assert_eq!(stream(CHINESE, &["。。", "🫠"]), (CHINESE.into(), None));
    }

    #[test]
    fn emoji_stops_across_byte_level_tokens() {
        // " 🫠" is " \xF0\x9F" + "\xAB" + "\xA0": the emoji starts inside the first token
        // and is complete only with the third.
        let text = "I am 🫠 melting, 👍🏽👍🏽 done";
        let ids = encode(text);
        assert_straddles(text, &ids, "🫠");
        assert_eq!(stream(text, &["🫠"]), ("I am ".into(), Some(4)));
        assert_straddles(text, &ids, "m 🫠 m");
        assert_eq!(stream(text, &["m 🫠 m"]).0, "I a");
        // Two tokens per emoji, the stop aligned to neither end of the pair.
        assert_eq!(stream(text, &["🏽👍"]).0, "I am 🫠 melting, 👍");
        assert_eq!(stream(text, &["🏽 d"]).0, "I am 🫠 melting, 👍🏽👍");
        // A stop string that shares only the first bytes of the emoji never matches it.
        assert_eq!(stream(text, &["🫡"]), (text.into(), None));
    }

    /// Characters of several widths and scripts; the tokenizer round-trips any string of them.
    const ALPHABET: &[&str] = &[
        " ", "\n", "a", "b", "ick", " br", "o", "。", "，", "你", "好", "世", "界", "天", "气", "”", "é", "ß", "ب",
        "ع", "🫠", "🪿", "🦀", "👍", "🏽", "\u{200D}", "👩", "🇯", "🇵", "龘", "𪚥", "ꙮ", "𝔘", "€",
    ];

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        #[test]
        fn random_stops_stream_like_the_reference(
            parts in proptest::collection::vec(proptest::sample::select(ALPHABET), 1..40),
            cuts in proptest::collection::vec((any::<proptest::sample::Index>(), 1usize..8), 1..3),
            absent in proptest::option::of(proptest::collection::vec(proptest::sample::select(ALPHABET), 1..4)),
        ) {
            let text: String = parts.concat();
            let chars: Vec<char> = text.chars().collect();
            // Stop strings cut from the text at any character, so most start inside a token.
            let mut stops: Vec<String> = cuts
                .iter()
                .map(|(at, len)| {
                    let a = at.index(chars.len());
                    chars[a..(a + len).min(chars.len())].iter().collect()
                })
                .collect();
            stops.extend(absent.map(|p| p.concat()));
            let stops: Vec<&str> = stops.iter().map(String::as_str).collect();
            let (out, step) = stream(&text, &stops);
            prop_assert!(step.is_some() || stops.iter().all(|s| !text.contains(s)));
            prop_assert!(stops.iter().all(|s| !out.contains(s)));
        }
    }
}

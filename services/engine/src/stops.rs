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

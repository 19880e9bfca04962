//! What to caption, streamed: paths (files, directories walked recursively, shell
//! globs), `--input-list` (a path or URL a line) and `--input-jsonl` (`{"id", "image" |
//! "audio", "prompt"?}` a line), read lazily so that a million-file folder costs one
//! directory handle at a time, not a million entries in memory.

use std::io::BufRead;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde_json::Value;

/// Where an item's bytes are.
#[derive(Debug, Clone, PartialEq)]
pub enum Source {
    File(PathBuf),
    Url(String),
}

/// One thing to caption.
#[derive(Debug, Clone)]
pub struct Item {
    /// What the output calls it: the path as walked, the URL, or the jsonl line's `id`.
    pub id: String,
    pub source: Source,
    /// A prompt of its own (`--input-jsonl`), instead of `--prompt`.
    pub prompt: Option<String>,
    /// The input folder it was found in (for `--format metadata`'s relative names).
    pub root: Option<PathBuf>,
    /// Found by walking a folder (not named by the user): a file that is not media is
    /// passed over quietly rather than reported.
    pub walked: bool,
}

/// An input that could not be read as one: reported as an error record under `id`.
#[derive(Debug, Clone)]
pub struct BadInput {
    pub id: String,
    pub error: String,
}

pub type Next = Result<Item, BadInput>;

/// File name extensions of media (a walked file with another one is only taken if its
/// content says it is media).
const MEDIA_EXTENSIONS: &[&str] =
    &["png", "jpg", "jpeg", "gif", "bmp", "webp", "wav", "flac", "mp3", "ogg", "oga", "m4a", "aac", "mp4"];

/// Files the caption command writes itself, never taken as inputs: `metadata.jsonl`,
/// journals, temporary files, and a `photo.txt` sidecar beside a `photo.jpg`.
fn is_ours(path: &Path) -> bool {
    let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
    if name == "metadata.jsonl" || name.ends_with(".journal.jsonl") || name.ends_with(".mmserve-tmp") {
        return true;
    }
    path.extension().is_some_and(|e| e == "txt")
        && MEDIA_EXTENSIONS
            .iter()
            .any(|e| path.with_extension(e).exists() || path.with_extension(e.to_uppercase()).exists())
}

/// Every input, in order, sent to `tx` (blocking: run it on a blocking thread). Stops
/// early when the receiver is gone.
pub fn produce(
    paths: &[String],
    list: Option<&Path>,
    jsonl: Option<&Path>,
    tx: &tokio::sync::mpsc::Sender<Next>,
) -> anyhow::Result<()> {
    let send = |n: Next| tx.blocking_send(n).is_ok();
    for p in paths {
        let matched: Vec<PathBuf> = if p.contains(['*', '?', '[']) {
            let globbed = glob::glob(p).with_context(|| format!("pattern {p:?}"))?;
            globbed.filter_map(Result::ok).collect()
        } else {
            vec![PathBuf::from(p)]
        };
        if matched.is_empty() && !send(Err(BadInput { id: p.clone(), error: "no file matches".into() })) {
            return Ok(());
        }
        for path in matched {
            if !walk(&path, &send) {
                return Ok(());
            }
        }
    }
    if let Some(list) = list {
        let f = std::fs::File::open(list).with_context(|| format!("--input-list {}", list.display()))?;
        for line in std::io::BufReader::new(f).lines() {
            let line = line.with_context(|| format!("reading {}", list.display()))?;
            let entry = line.trim();
            if entry.is_empty() || entry.starts_with('#') {
                continue;
            }
            let item = if entry.starts_with("http://") || entry.starts_with("https://") {
                Item { id: entry.into(), source: Source::Url(entry.into()), prompt: None, root: None, walked: false }
            } else {
                file_item(PathBuf::from(entry), None, false)
            };
            if !send(Ok(item)) {
                return Ok(());
            }
        }
    }
    if let Some(jsonl) = jsonl {
        let f = std::fs::File::open(jsonl).with_context(|| format!("--input-jsonl {}", jsonl.display()))?;
        for (n, line) in std::io::BufReader::new(f).lines().enumerate() {
            let line = line.with_context(|| format!("reading {}", jsonl.display()))?;
            if line.trim().is_empty() {
                continue;
            }
            if !send(jsonl_item(&line, n + 1)) {
                return Ok(());
            }
        }
    }
    Ok(())
}

fn file_item(path: PathBuf, root: Option<PathBuf>, walked: bool) -> Item {
    Item { id: path.display().to_string(), source: Source::File(path), prompt: None, root, walked }
}

/// A file, or every file below a directory (sorted per directory, so runs agree on the
/// order), depth first with one directory listing in memory at a time per level.
/// Returns false when the receiver is gone.
fn walk(path: &Path, send: &impl Fn(Next) -> bool) -> bool {
    if !path.is_dir() {
        return send(Ok(file_item(path.to_path_buf(), None, false)));
    }
    let root = path.to_path_buf();
    for entry in walkdir::WalkDir::new(path).follow_links(false).sort_by_file_name() {
        let entry = match entry {
            Ok(e) => e,
            Err(e) => {
                let id = e.path().map_or_else(|| root.display().to_string(), |p| p.display().to_string());
                if !send(Err(BadInput { id, error: e.to_string() })) {
                    return false;
                }
                continue;
            }
        };
        let p = entry.path();
        let hidden = entry.file_name().to_str().is_some_and(|n| n.starts_with('.')) && entry.depth() > 0;
        if hidden || !entry.file_type().is_file() || is_ours(p) {
            continue;
        }
        if !send(Ok(file_item(p.to_path_buf(), Some(root.clone()), true))) {
            return false;
        }
    }
    true
}

fn jsonl_item(line: &str, n: usize) -> Next {
    let bad = |error: String| BadInput { id: format!("line {n}"), error };
    let v: Value = serde_json::from_str(line).map_err(|e| bad(format!("not JSON: {e}")))?;
    let media = v.get("image").or_else(|| v.get("audio")).and_then(Value::as_str);
    let Some(media) = media else { return Err(bad("no \"image\" or \"audio\" field".into())) };
    let id = match v.get("id") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Number(x)) => x.to_string(),
        _ => media.to_string(),
    };
    let prompt = match v.get("prompt") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(BadInput { id, error: "\"prompt\" is not a string".into() }),
    };
    let source = if media.starts_with("http://") || media.starts_with("https://") {
        Source::Url(media.into())
    } else {
        Source::File(media.into())
    };
    Ok(Item { id, source, prompt, root: None, walked: false })
}

/// Whether a walked file's name says media (then an unreadable one is an error, not noise).
pub fn has_media_extension(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| MEDIA_EXTENSIONS.contains(&e.to_ascii_lowercase().as_str()))
}

/// What a file's first bytes say it is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Image,
    /// Audio, with the `input_audio.format` name the chat API takes.
    Audio(&'static str),
}

/// Media by content (magic numbers), not by name.
pub fn sniff(b: &[u8]) -> Option<Kind> {
    let at = |i: usize, m: &[u8]| b.len() >= i + m.len() && &b[i..i + m.len()] == m;
    if at(0, b"\x89PNG\r\n\x1a\n") || at(0, b"\xff\xd8\xff") || at(0, b"GIF8") || at(0, b"BM") {
        return Some(Kind::Image);
    }
    if at(0, b"RIFF") && at(8, b"WEBP") {
        return Some(Kind::Image);
    }
    if at(0, b"RIFF") && at(8, b"WAVE") {
        return Some(Kind::Audio("wav"));
    }
    if at(0, b"fLaC") {
        return Some(Kind::Audio("flac"));
    }
    if at(0, b"OggS") {
        return Some(Kind::Audio("ogg"));
    }
    if at(0, b"ID3") || (b.len() >= 2 && b[0] == 0xff && b[1] & 0xe0 == 0xe0 && b[1] & 0x06 != 0) {
        return Some(Kind::Audio("mp3"));
    }
    if at(4, b"ftyp") {
        return Some(Kind::Audio("m4a"));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn media_is_told_by_content() {
        assert_eq!(sniff(b"\x89PNG\r\n\x1a\n...."), Some(Kind::Image));
        assert_eq!(sniff(b"\xff\xd8\xff\xe0"), Some(Kind::Image));
        assert_eq!(sniff(b"RIFF\0\0\0\0WEBPVP8 "), Some(Kind::Image));
        assert_eq!(sniff(b"RIFF\0\0\0\0WAVEfmt "), Some(Kind::Audio("wav")));
        assert_eq!(sniff(b"fLaC\0"), Some(Kind::Audio("flac")));
        assert_eq!(sniff(b"ID3\x04"), Some(Kind::Audio("mp3")));
        assert_eq!(sniff(b"hello, world"), None);
        assert_eq!(sniff(b""), None);
    }

    #[test]
    fn jsonl_lines_name_their_item_or_say_what_is_wrong() {
        let ok = jsonl_item(r#"{"id": 7, "image": "a/b.png", "prompt": "What?"}"#, 1).unwrap();
        assert_eq!((ok.id.as_str(), ok.prompt.as_deref()), ("7", Some("What?")));
        assert_eq!(ok.source, Source::File("a/b.png".into()));
        let url = jsonl_item(r#"{"audio": "https://x.example/a.wav"}"#, 2).unwrap();
        assert_eq!(url.id, "https://x.example/a.wav");
        assert!(jsonl_item("not json", 3).unwrap_err().error.contains("not JSON"));
        assert!(jsonl_item(r#"{"id": "x"}"#, 4).unwrap_err().error.contains("no \"image\""));
    }
}

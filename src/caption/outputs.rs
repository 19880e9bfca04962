//! The output formats. The journal (`jsonl`) is written as items finish; `csv` and
//! `metadata` are rendered from it when the run ends (each written whole, atomically);
//! `sidecar` writes `photo.txt` beside `photo.jpg` as each caption arrives (atomically).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::Context;
use serde_json::{Value, json};

use super::journal::{Done, write_atomically};

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Format {
    /// One JSON object per item (the journal itself).
    Jsonl,
    /// A CSV file (the journal beside it, `OUT.journal.jsonl`).
    Csv,
    /// `name.txt` beside each `name.jpg` (the journal at `--out`).
    Sidecar,
    /// Hugging Face ImageFolder's `metadata.jsonl` in each input folder (the journal at `--out`).
    Metadata,
}

/// The resume key of an item record: its id, content digest, settings and whether it
/// succeeded.
pub fn key(v: &Value) -> Option<(String, Done)> {
    let id = v.get("id")?.as_str()?.to_string();
    let s = |k: &str| v.get(k).and_then(Value::as_str).unwrap_or_default().to_string();
    Some((id, Done { digest: s("digest"), settings: s("settings"), ok: v.get("error").is_none_or(Value::is_null) }))
}

/// The CSV of the records (RFC 4180 quoting), one row per item.
pub fn csv(records: &[Value]) -> String {
    const COLUMNS: [&str; 8] =
        ["id", "digest", "caption", "prompt_tokens", "completion_tokens", "finish_reason", "latency_ms", "error"];
    let mut out = COLUMNS.join(",");
    out.push_str("\r\n");
    for r in records {
        let cells: Vec<String> = COLUMNS
            .iter()
            .map(|c| match &r[*c] {
                Value::Null => String::new(),
                Value::String(s) => quote(s),
                other => quote(&other.to_string()),
            })
            .collect();
        out.push_str(&cells.join(","));
        out.push_str("\r\n");
    }
    out
}

fn quote(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) { format!("\"{}\"", s.replace('"', "\"\"")) } else { s.to_string() }
}

/// The sidecar of a media file: its path with a `.txt` extension.
pub fn sidecar_path(media: &Path) -> PathBuf {
    media.with_extension("txt")
}

pub fn write_sidecar(media: &Path, caption: &str) -> anyhow::Result<()> {
    let path = sidecar_path(media);
    write_atomically(&path, caption.as_bytes()).with_context(|| format!("writing {}", path.display()))
}

/// `metadata.jsonl` of each input folder: `{"file_name": path relative to the folder,
/// column: caption}` for each captioned file in it. Returns the files written.
pub fn write_metadata(records: &[Value], column: &str) -> anyhow::Result<Vec<PathBuf>> {
    let mut by_root: BTreeMap<PathBuf, String> = BTreeMap::new();
    for r in records {
        let (Some(root), Some(path), Some(caption)) =
            (r["root"].as_str(), r["path"].as_str(), r["caption"].as_str().filter(|_| r["error"].is_null()))
        else {
            continue;
        };
        let Ok(rel) = Path::new(path).strip_prefix(root) else { continue };
        let line = json!({"file_name": rel.to_string_lossy(), column: caption});
        let text = by_root.entry(PathBuf::from(root)).or_default();
        text.push_str(&line.to_string());
        text.push('\n');
    }
    let mut written = Vec::new();
    for (root, text) in by_root {
        let path = root.join("metadata.jsonl");
        write_atomically(&path, text.as_bytes())?;
        written.push(path);
    }
    Ok(written)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn csv_quotes_what_needs_quoting() {
        let r = json!({"id": "a,b.png", "digest": "d", "caption": "He said \"hi\"\nthen left", "prompt_tokens": 3,
                       "completion_tokens": 4, "finish_reason": "stop", "latency_ms": 1.5, "error": null});
        let text = csv(&[r]);
        let row = text.split("\r\n").nth(1).unwrap();
        assert!(row.starts_with("\"a,b.png\",d,\"He said \"\"hi\"\"\nthen left\",3,4,stop,1.5,"), "{row}");
    }

    #[test]
    fn metadata_names_files_relative_to_their_folder() {
        let d = std::env::temp_dir().join(format!("mmserve-metadata-test-{}", std::process::id()));
        std::fs::create_dir_all(d.join("sub")).unwrap();
        let root = d.to_string_lossy().to_string();
        let rec = |p: &str, c: &str, e: Value| json!({"root": root, "path": d.join(p).to_string_lossy(), "caption": c, "error": e});
        let written =
            write_metadata(&[rec("sub/a.png", "A cat.", Value::Null), rec("b.png", "", "broken".into())], "text")
                .unwrap();
        assert_eq!(written, vec![d.join("metadata.jsonl")]);
        let text = std::fs::read_to_string(d.join("metadata.jsonl")).unwrap();
        assert_eq!(text, "{\"file_name\":\"sub/a.png\",\"text\":\"A cat.\"}\n");
        std::fs::remove_dir_all(d).unwrap();
    }
}

//! The run's journal: one JSON object per line, one line per finished item, appended
//! with one `write` per line (O_APPEND) and synced at bounded intervals. It is what
//! makes a run resumable and crash-safe: on start the journal is read back (a last line
//! torn by a crash, the only kind there can be, is cut off), and an item whose record is
//! there with the same content digest and settings is not done again. When the same
//! item was done twice (changed settings, `--retry-failed`), the later record wins, and
//! [`Journal::compact`] rewrites the file with one record per item.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io::{BufRead, Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use serde_json::Value;

/// How often appended lines are synced to disk (a crash loses at most the lines of this
/// interval from the disk's view; the file never holds a partial line but the last).
const SYNC_EVERY: Duration = Duration::from_secs(2);

/// What the journal says about an item.
#[derive(Debug, Clone)]
pub struct Done {
    pub digest: String,
    pub settings: String,
    pub ok: bool,
}

pub struct Journal {
    path: PathBuf,
    file: File,
    /// Records by id (the last one for each).
    pub done: HashMap<String, Done>,
    /// Records in the file (with duplicates).
    lines: usize,
    synced: Instant,
}

/// The key fields of a record line: (id, done); `None` for a line that is not one.
fn parse(line: &str, key: &dyn Fn(&Value) -> Option<(String, Done)>) -> Option<(String, Done)> {
    key(&serde_json::from_str(line).ok()?)
}

impl Journal {
    /// Opens (or creates) `path`, cutting a torn last line off, and reads what is done.
    /// `key` picks a record's id and state out of a line.
    pub fn open(path: &Path, key: &dyn Fn(&Value) -> Option<(String, Done)>) -> anyhow::Result<Journal> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        }
        let mut file = OpenOptions::new()
            .read(true)
            .append(true)
            .create(true)
            .open(path)
            .with_context(|| format!("opening {}", path.display()))?;
        repair(&mut file).with_context(|| format!("repairing {}", path.display()))?;
        file.seek(SeekFrom::Start(0))?;
        let mut done = HashMap::new();
        let mut lines = 0;
        for line in std::io::BufReader::new(&file).lines() {
            let line = line.with_context(|| format!("reading {}", path.display()))?;
            if let Some((id, d)) = parse(&line, key) {
                done.insert(id, d);
                lines += 1;
            }
        }
        Ok(Journal { path: path.to_path_buf(), file, done, lines, synced: Instant::now() })
    }

    /// Appends one record as one line (one write call), syncing at most every
    /// [`SYNC_EVERY`].
    pub fn append(&mut self, record: &Value) -> anyhow::Result<()> {
        let mut line = serde_json::to_string(record)?;
        line.push('\n');
        self.file.write_all(line.as_bytes()).with_context(|| format!("writing {}", self.path.display()))?;
        self.lines += 1;
        if self.synced.elapsed() >= SYNC_EVERY {
            self.sync()?;
        }
        Ok(())
    }

    pub fn sync(&mut self) -> anyhow::Result<()> {
        self.file.sync_data().with_context(|| format!("syncing {}", self.path.display()))?;
        self.synced = Instant::now();
        Ok(())
    }

    /// The records of the file, the last per id, in file order of those last records.
    fn records(&self, key: &dyn Fn(&Value) -> Option<(String, Done)>) -> anyhow::Result<Vec<Value>> {
        let text = std::fs::read_to_string(&self.path).with_context(|| format!("reading {}", self.path.display()))?;
        let mut last: HashMap<String, usize> = HashMap::new();
        let mut values = Vec::new();
        for line in text.lines() {
            let Ok(v) = serde_json::from_str::<Value>(line) else { continue };
            let Some((id, _)) = key(&v) else { continue };
            last.insert(id, values.len());
            values.push(v);
        }
        let mut keep: Vec<usize> = last.into_values().collect();
        keep.sort_unstable();
        Ok(keep.into_iter().map(|i| std::mem::take(&mut values[i])).collect())
    }

    /// Rewrites the file with one record per item, if it holds more (atomically: a
    /// sibling file, synced, renamed over it); returns those records.
    pub fn compact(&mut self, key: &dyn Fn(&Value) -> Option<(String, Done)>) -> anyhow::Result<Vec<Value>> {
        self.sync()?;
        let records = self.records(key)?;
        if records.len() == self.lines {
            return Ok(records);
        }
        let mut text = String::new();
        for r in &records {
            text.push_str(&serde_json::to_string(r)?);
            text.push('\n');
        }
        write_atomically(&self.path, text.as_bytes())?;
        self.file = OpenOptions::new().read(true).append(true).open(&self.path)?;
        self.lines = records.len();
        Ok(records)
    }
}

/// Cuts the file after its last newline: a line a crash cut short is dropped (the item
/// is done again), every complete line kept.
fn repair(file: &mut File) -> std::io::Result<()> {
    let len = file.metadata()?.len();
    if len == 0 {
        return Ok(());
    }
    // Walk back in chunks to the last newline.
    let mut end = len;
    let mut buf = vec![0u8; 64 * 1024];
    while end > 0 {
        let start = end.saturating_sub(buf.len() as u64);
        let n = (end - start) as usize;
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(&mut buf[..n])?;
        if let Some(i) = buf[..n].iter().rposition(|&b| b == b'\n') {
            let keep = start + i as u64 + 1;
            if keep < len {
                file.set_len(keep)?;
            }
            return Ok(());
        }
        end = start;
    }
    file.set_len(0)
}

/// Writes `bytes` to `path` through a synced sibling and a rename: readers see the old
/// file or the new one, never a part.
pub fn write_atomically(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let mut tmp = path.as_os_str().to_owned();
    tmp.push(format!(".{}.mmserve-tmp", std::process::id()));
    let tmp = PathBuf::from(tmp);
    let mut f = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    f.write_all(bytes)?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path).with_context(|| format!("renaming {} over {}", tmp.display(), path.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(v: &Value) -> Option<(String, Done)> {
        let id = v.get("id")?.as_str()?.to_string();
        Some((id, Done { digest: String::new(), settings: String::new(), ok: v.get("error")?.is_null() }))
    }

    fn dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("mmserve-journal-test-{}-{:?}", std::process::id(), Instant::now()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn a_torn_last_line_is_cut_and_complete_lines_kept() {
        let d = dir();
        let p = d.join("j.jsonl");
        std::fs::write(&p, "{\"id\":\"a\",\"error\":null}\n{\"id\":\"b\",\"error\":null}\n{\"id\":\"c\",\"err")
            .unwrap();
        let j = Journal::open(&p, &key).unwrap();
        assert_eq!(j.done.len(), 2);
        assert!(std::fs::read_to_string(&p).unwrap().ends_with("null}\n"));
        std::fs::remove_dir_all(d).unwrap();
    }

    #[test]
    fn the_last_record_wins_and_compaction_keeps_one_per_item() {
        let d = dir();
        let p = d.join("j.jsonl");
        let mut j = Journal::open(&p, &key).unwrap();
        for (id, err) in [("a", Value::Null), ("b", "boom".into()), ("b", Value::Null)] {
            j.append(&serde_json::json!({"id": id, "error": err})).unwrap();
        }
        j.compact(&key).unwrap();
        let j = Journal::open(&p, &key).unwrap();
        assert_eq!(j.lines, 2);
        assert!(j.done["b"].ok);
        assert_eq!(std::fs::read_to_string(&p).unwrap().lines().count(), 2);
        std::fs::remove_dir_all(d).unwrap();
    }
}

//! `--model org/name`: a Hugging Face hub id, resolved offline in the local Hugging Face
//! cache as `huggingface_hub` lays it out (no download is ever attempted): the cache is
//! `$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub`; the model is
//! `models--org--name/snapshots/<revision>`, the revision `refs/main` names (or the only
//! snapshot there is).

use std::path::{Path, PathBuf};

use crate::ConfigError;

/// Whether `given` reads as a hub id (`org/name`, or `name`) rather than a path.
pub fn looks_like_hub_id(given: &Path) -> bool {
    let Some(s) = given.to_str() else { return false };
    let parts: Vec<&str> = s.split('/').collect();
    let ok = |p: &str| {
        !p.is_empty() && p != "." && p != ".." && p.chars().all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
    };
    matches!(parts.len(), 1 | 2) && parts.iter().all(|p| ok(p)) && !s.starts_with('.')
}

/// The hub cache directory from the environment.
pub fn cache_dir() -> PathBuf {
    let var = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
    var("HF_HUB_CACHE")
        .or_else(|| var("HF_HOME").map(|h| h.join("hub")))
        .or_else(|| var("XDG_CACHE_HOME").map(|c| c.join("huggingface/hub")))
        .unwrap_or_else(|| var("HOME").unwrap_or_default().join(".cache/huggingface/hub"))
}

/// The snapshot directory of hub id `id` in `cache`, or an error that says where it
/// looked.
pub fn resolve(id: &str, cache: &Path) -> Result<PathBuf, ConfigError> {
    let repo = cache.join(format!("models--{}", id.replace('/', "--")));
    let missing =
        |why: &str| ConfigError::NotInHubCache { id: id.to_string(), looked: repo.clone(), why: why.to_string() };
    let snapshots = repo.join("snapshots");
    if !snapshots.is_dir() {
        return Err(missing("no such directory (download it with `huggingface-cli download`, or pass a directory)"));
    }
    if let Ok(rev) = std::fs::read_to_string(repo.join("refs/main")) {
        let dir = snapshots.join(rev.trim());
        if dir.is_dir() {
            return Ok(dir);
        }
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir(&snapshots)
        .map_err(|_| missing("unreadable snapshots directory"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.is_dir())
        .collect();
    match found.len() {
        1 => Ok(found.remove(0)),
        0 => Err(missing("no snapshot")),
        _ => Err(missing("several snapshots and no refs/main to choose one")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hub_ids_and_paths() {
        assert!(looks_like_hub_id(Path::new("Qwen/Qwen2-VL-7B-Instruct")));
        assert!(looks_like_hub_id(Path::new("gpt2")));
        for path in ["/models/x", "./x", "a/b/c", "../x", "assets/models/", ""] {
            assert!(!looks_like_hub_id(Path::new(path)), "{path}");
        }
    }

    #[test]
    fn resolves_refs_main_or_the_only_snapshot_and_says_where_it_looked() {
        let cache = std::env::temp_dir().join(format!("mmserve-hub-test-{}", std::process::id()));
        let repo = cache.join("models--org--m");
        std::fs::create_dir_all(repo.join("snapshots/abc")).unwrap();
        assert_eq!(resolve("org/m", &cache).unwrap(), repo.join("snapshots/abc"));
        std::fs::create_dir_all(repo.join("snapshots/def")).unwrap();
        let e = resolve("org/m", &cache).unwrap_err().to_string();
        assert!(e.contains("several snapshots"), "{e}");
        std::fs::create_dir_all(repo.join("refs")).unwrap();
        std::fs::write(repo.join("refs/main"), "def\n").unwrap();
        assert_eq!(resolve("org/m", &cache).unwrap(), repo.join("snapshots/def"));
        let e = resolve("org/other", &cache).unwrap_err().to_string();
        assert!(e.contains("models--org--other"), "{e}");
        std::fs::remove_dir_all(&cache).unwrap();
    }
}

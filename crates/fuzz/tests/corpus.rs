//! Replays every committed input of every fuzz target: the seeds (`fuzz/seeds/`) and
//! the inputs that once crashed a target (`fuzz/regressions/`). A panic fails the test
//! and names the file.

use std::path::{Path, PathBuf};

fn inputs(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|d| d.filter_map(|e| e.ok().map(|e| e.path())).filter(|p| p.is_file()).collect())
        .unwrap_or_default();
    files.sort();
    files
}

#[test]
fn every_committed_input_is_handled_without_panicking() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fuzz");
    for (name, target) in mmserve_fuzz::TARGETS {
        let seeds = inputs(&root.join("seeds").join(name));
        assert!(!seeds.is_empty(), "fuzz/seeds/{name} has no seeds");
        for file in seeds.iter().chain(&inputs(&root.join("regressions").join(name))) {
            let data = std::fs::read(file).unwrap();
            if std::panic::catch_unwind(|| target(&data)).is_err() {
                panic!("{name} panicked on {}", file.display());
            }
        }
    }
}

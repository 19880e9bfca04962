//! What a run tells its user: a progress bar on a terminal (done / total, items and
//! output tokens per second, ETA, failures), a line every few seconds otherwise, nothing
//! with `--quiet`; and the summary at the end.

use std::io::IsTerminal;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// Between two progress lines when stderr is not a terminal.
const LOG_EVERY: Duration = Duration::from_secs(10);

#[derive(Debug, Default, Clone, Copy)]
pub struct Counts {
    /// Seconds of audio captioned (where the containers state their length).
    pub audio_seconds: f64,
    /// Items captioned (or answered) in this run.
    pub done: u64,
    /// Items found done by an earlier run.
    pub skipped: u64,
    pub failed: u64,
    /// Files in walked folders that are not media.
    pub not_media: u64,
    pub output_tokens: u64,
}

pub struct Progress {
    bar: Option<ProgressBar>,
    quiet: bool,
    started: Instant,
    logged: Instant,
    pub counts: Counts,
    /// Inputs taken from the listing so far (the total once it is done).
    seen: Arc<AtomicU64>,
    listed: bool,
}

impl Progress {
    pub fn new(quiet: bool) -> Self {
        let bar = (!quiet && std::io::stderr().is_terminal()).then(|| {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr_with_hz(4));
            let style = ProgressStyle::with_template("{bar:30} {pos}/{len} items  {per_sec}  {msg}  ETA {eta}")
                .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style);
            bar
        });
        let (started, seen) = (Instant::now(), Arc::new(AtomicU64::new(0)));
        Progress { bar, quiet, started, logged: started, counts: Counts::default(), seen, listed: false }
    }

    /// The counter of inputs taken from the listing, for the stream that takes them.
    pub fn seen(&self) -> Arc<AtomicU64> {
        self.seen.clone()
    }

    /// Every input is listed: the total is known.
    pub fn listed(&mut self) {
        self.listed = true;
    }

    /// An item finished (`done`, `skipped`, `failed` or not media).
    pub fn finished(&mut self) {
        let c = self.counts;
        let seen = self.seen.load(Ordering::Relaxed);
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        let msg = format!("{:.1} tok/s  {} failed", c.output_tokens as f64 / secs, c.failed);
        match &self.bar {
            Some(bar) => {
                bar.set_length(seen);
                bar.set_position(c.done + c.skipped + c.failed + c.not_media);
                bar.set_message(msg);
            }
            None if !self.quiet && self.logged.elapsed() >= LOG_EVERY => {
                self.logged = Instant::now();
                let total = if self.listed { seen.to_string() } else { format!("{seen}+") };
                eprintln!(
                    "mmserve caption: {}/{total} items ({} skipped), {:.2} items/s, {msg}",
                    c.done + c.skipped + c.failed + c.not_media,
                    c.skipped,
                    c.done as f64 / secs
                );
            }
            None => {}
        }
    }

    /// Clears the bar and prints the summary (to stderr; stdout stays for data).
    pub fn summary(&self, cache_hits: Option<u64>) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
        if self.quiet {
            return;
        }
        let c = self.counts;
        let secs = self.started.elapsed().as_secs_f64().max(1e-9);
        eprintln!(
            "mmserve caption: {} done, {} skipped (done before), {} failed{} in {secs:.1} s: {:.2} items/s, {:.1} output tok/s{}",
            c.done,
            c.skipped,
            c.failed,
            if c.not_media > 0 { format!(", {} not media", c.not_media) } else { String::new() },
            c.done as f64 / secs,
            c.output_tokens as f64 / secs,
            cache_hits.map_or_else(String::new, |h| format!(", {h} embed-cache hits"))
        );
        if c.audio_seconds > 0.0 {
            eprintln!(
                "mmserve caption: {:.1} s of audio, {:.1} s of audio per second",
                c.audio_seconds,
                c.audio_seconds / secs
            );
        }
    }
}

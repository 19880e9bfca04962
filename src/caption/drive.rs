//! The loop both modes share: inputs listed on a blocking thread into a channel of
//! `concurrency` places, at most that many worked on at once, and each finished one
//! appended to the journal whole, then counted, until the inputs end or Ctrl-C.

use std::sync::atomic::Ordering;

use anyhow::{Context, bail};
use futures::StreamExt;
use serde_json::Value;

use super::journal::Journal;
use super::progress::Progress;

/// Runs `list` (which sends the inputs) and `work` on each input (a journal line, or
/// `None` for an input an earlier run did), appending the lines to `journal` and handing
/// each to `count`. Returns whether Ctrl-C stopped it.
pub async fn drive<I, W, F>(
    concurrency: usize,
    list: impl FnOnce(tokio::sync::mpsc::Sender<I>) -> anyhow::Result<()> + Send + 'static,
    work: W,
    journal: &mut Journal,
    progress: &mut Progress,
    mut count: impl FnMut(&Value, &mut Progress) -> anyhow::Result<()>,
) -> anyhow::Result<bool>
where
    I: Send + 'static,
    W: FnMut(I) -> F,
    F: Future<Output = Option<Value>>,
{
    let concurrency = concurrency.max(1);
    let (tx, rx) = tokio::sync::mpsc::channel::<I>(concurrency);
    let mut lister = std::pin::pin!(tokio::task::spawn_blocking(move || list(tx)));
    let seen = progress.seen();
    let inputs = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) });
    let mut results = Box::pin(
        inputs
            .inspect(|_| {
                seen.fetch_add(1, Ordering::Relaxed);
            })
            .map(work)
            .buffer_unordered(concurrency),
    );
    let mut listing = true;
    // One listener for the whole run, so that no Ctrl-C falls between two waits.
    let mut ctrl_c = std::pin::pin!(tokio::signal::ctrl_c());
    loop {
        tokio::select! {
            r = &mut lister, if listing => {
                listing = false;
                progress.listed();
                r.context("listing the inputs")??;
            }
            next = results.next() => {
                match next {
                    None => return Ok(false),
                    Some(None) => progress.counts.skipped += 1,
                    Some(Some(line)) => {
                        journal.append(&line)?;
                        count(&line, progress)?;
                    }
                }
                progress.finished();
            }
            _ = &mut ctrl_c => return Ok(true),
        }
    }
}

/// How a run ended, for the exit status: interrupted, some `what` failed, or all well.
pub fn outcome(progress: &Progress, interrupted: bool, what: &str) -> anyhow::Result<()> {
    if interrupted {
        bail!("interrupted: the output is valid; run the same command again to resume");
    }
    let failed = progress.counts.failed;
    if failed > 0 {
        bail!("{failed} {what} failed (see their errors); --retry-failed does them again");
    }
    Ok(())
}

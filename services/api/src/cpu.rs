//! The api's bounded pool for CPU work a request causes (media checks and hashing,
//! audio decoding, rendering and tokenizing the prompt): at most `--media-workers`
//! jobs run at once on blocking threads, so one expensive request cannot stall the
//! event loop or the others, and a burst waits in line (at most [`WAIT`]) instead of
//! multiplying memory.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::error::ApiError;

/// Longest wait for a place in the pool.
pub const WAIT: Duration = Duration::from_secs(30);

/// Runs `job` on a blocking thread once the pool has room.
pub async fn run<T: Send + 'static>(
    slots: &Arc<Semaphore>,
    what: &str,
    job: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    let permit = tokio::time::timeout(WAIT, slots.clone().acquire_owned())
        .await
        .map_err(|_| ApiError::Unavailable(format!("the server is busy {what}; try again")))?
        .map_err(|_| ApiError::Internal("the CPU pool is closed".into()))?;
    tokio::task::spawn_blocking(move || {
        let _permit = permit;
        job()
    })
    .await
    .map_err(|e| ApiError::Internal(format!("{what}: {e}")))
}

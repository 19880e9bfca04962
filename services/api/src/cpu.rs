//! The api's bounded pool for CPU work a request causes (media checks and hashing,
//! audio decoding, rendering and tokenizing the prompt): at most `--media-workers`
//! jobs run at once on blocking threads, so one expensive request cannot stall the
//! event loop or the others, and a burst waits in line (at most `--cpu-wait-timeout-s`)
//! instead of multiplying memory.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Semaphore;

use crate::error::ApiError;

/// The pool's places and how long a job may wait for one.
#[derive(Debug, Clone)]
pub struct Pool {
    slots: Arc<Semaphore>,
    wait: Duration,
}

impl Pool {
    pub fn new(places: usize, wait: Duration) -> Self {
        Pool { slots: Arc::new(Semaphore::new(places.max(1))), wait }
    }
}

/// Runs `job` on a blocking thread once the pool has room.
pub async fn run<T: Send + 'static>(
    pool: &Pool,
    what: &str,
    job: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    let permit = tokio::time::timeout(pool.wait, pool.slots.clone().acquire_owned())
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

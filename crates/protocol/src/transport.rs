//! Unix-socket transport for every tarpc service.
//!
//! Unix sockets rather than loopback TCP: all processes share one host (they share
//! memory already), connection set-up needs no port allocation, and the socket file's
//! permissions keep other users out. Frames are length-delimited bincode.

use std::{io, path::Path, time::Duration};

use serde::{Serialize, de::DeserializeOwned};
use tarpc::{serde_transport::Transport, tokio_serde::formats::Bincode};
use tokio::net::{UnixListener, UnixStream};
use tokio_util::codec::LengthDelimitedCodec;

/// Largest frame on any connection (a request's prompt ids, an event batch).
const MAX_FRAME: usize = 64 << 20;

pub type UnixTransport<In, Out> = Transport<UnixStream, In, Out, Bincode<In, Out>>;

fn wrap<In, Out>(stream: UnixStream) -> UnixTransport<In, Out>
where
    In: DeserializeOwned,
    Out: Serialize,
{
    let framed = LengthDelimitedCodec::builder().max_frame_length(MAX_FRAME).new_framed(stream);
    tarpc::serde_transport::new(framed, Bincode::default())
}

/// Connects to a service's socket, waiting at most `timeout`.
pub async fn connect<In, Out>(path: &Path, timeout: Duration) -> io::Result<UnixTransport<In, Out>>
where
    In: DeserializeOwned,
    Out: Serialize,
{
    let stream = tokio::time::timeout(timeout, UnixStream::connect(path))
        .await
        .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, format!("connecting to {}", path.display())))??;
    Ok(wrap(stream))
}

/// Binds `path` (replacing a stale socket file) and returns the listener. Bind before
/// announcing readiness, then hand the listener to [`serve`].
pub fn bind(path: &Path) -> io::Result<UnixListener> {
    match std::fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(e),
    }
    UnixListener::bind(path)
}

/// Wraps an accepted connection as the server end of a tarpc channel.
pub fn server_transport<Req, Resp>(
    stream: UnixStream,
) -> UnixTransport<tarpc::ClientMessage<Req>, tarpc::Response<Resp>>
where
    Req: DeserializeOwned,
    Resp: Serialize,
{
    wrap(stream)
}

/// Serves every connection of a bound listener with a tarpc `Serve` value (what the
/// service trait's `.serve()` returns), each request on
/// its own task, forever. A macro because each service's request futures are concrete
/// types whose `Send`-ness a generic function cannot name.
#[macro_export]
macro_rules! serve_unix {
    ($listener:expr, $server:expr) => {{
        use $crate::__private::{Channel as _, StreamExt as _};
        let listener: $crate::__private::UnixListener = $listener;
        let serve = $server;
        loop {
            match listener.accept().await {
                Ok((stream, _)) => {
                    let channel =
                        $crate::__private::BaseChannel::with_defaults($crate::transport::server_transport(stream));
                    $crate::__private::spawn(channel.execute(serve.clone()).for_each(|response| async move {
                        $crate::__private::spawn(response);
                    }));
                }
                Err(e) => $crate::__private::warn!("accept failed: {e}"),
            }
        }
    }};
}

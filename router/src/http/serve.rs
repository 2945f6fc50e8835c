//! The HTTP accept loop (in place of `axum::serve`, which sets no timer and no connection cap): each TCP
//! connection is served by hyper's HTTP/1.1 (no HTTP/2 sniffing: that would wait for a silent client's
//! first bytes with no timer running) with
//! - a header read timeout: once hyper waits for a request head (on connect, and after each answer on a
//!   kept-alive connection) the whole head must arrive within it, else the connection is closed — this
//!   bounds slow-header clients, silent connections and idle kept-alive ones alike;
//! - a cap on connections open at once: one beyond it is closed as soon as it is accepted;
//! - a small kernel send buffer for unsent bytes (`TCP_NOTSENT_LOWAT`), so a client that stops reading
//!   stops its stream being pulled within a few KiB: what it leaves unread piles up in its request's
//!   bounded event channel, where the engine sees it (`--max-unread-tokens`), not in megabytes of socket
//!   buffer.
//!
//! On shutdown the listener closes, open connections finish the request they are answering and close,
//! and after a grace period any left are dropped.

use std::{future::Future, net::SocketAddr, sync::Arc, time::Duration};

use axum::Router;
use hyper_util::{
    rt::{TokioExecutor, TokioIo, TokioTimer},
    server::{conn::auto::Builder, graceful::GracefulShutdown},
    service::TowerToHyperService,
};
use tokio::{net::TcpListener, sync::Semaphore};

use crate::config::ConnectionConfig;

/// How long open connections get to close after the shutdown signal (requests in flight have been
/// drained by then; this covers a client slow to read its last bytes).
const CLOSE_GRACE: Duration = Duration::from_secs(5);
/// Pause after a failed accept (out of file descriptors, say) before trying again.
const ACCEPT_RETRY_DELAY: Duration = Duration::from_millis(50);
/// Unsent bytes a connection's socket may hold before it stops taking more (`TCP_NOTSENT_LOWAT`):
/// about a hundred token events of a stream.
const MAX_UNSENT_BYTES: u32 = 16 << 10;

/// Serves `app` on `listener` until `shutdown` completes, then closes connections gracefully.
pub async fn serve(listener: TcpListener, app: Router, limits: ConnectionConfig, shutdown: impl Future<Output = ()>) {
    let mut builder = Builder::new(TokioExecutor::new()).http1_only();
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout);
    let permits = Arc::new(Semaphore::new(limits.max_connections));
    let graceful = GracefulShutdown::new();
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    tracing::warn!(%error, "accepting a connection failed");
                    tokio::time::sleep(ACCEPT_RETRY_DELAY).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let Ok(permit) = permits.clone().try_acquire_owned() else {
            refuse(peer, limits.max_connections);
            continue; // dropping the stream closes it
        };
        limit_unsent_bytes(&stream, peer);
        let service = TowerToHyperService::new(app.clone());
        let connection = builder.serve_connection(TokioIo::new(stream), service);
        let connection = graceful.watch(connection.into_owned());
        tokio::spawn(async move {
            if let Err(error) = connection.await {
                tracing::debug!(%peer, %error, "connection ended with an error");
            }
            drop(permit);
        });
    }
    drop(listener);
    if tokio::time::timeout(CLOSE_GRACE, graceful.shutdown()).await.is_err() {
        tracing::warn!("connections still open after the grace period; dropping them");
    }
}

/// Sets `TCP_NOTSENT_LOWAT` (Linux; elsewhere the socket keeps its buffers and slow readers are caught
/// later, once those are full).
fn limit_unsent_bytes(stream: &tokio::net::TcpStream, peer: SocketAddr) {
    #[cfg(target_os = "linux")]
    if let Err(error) = socket2::SockRef::from(stream).set_tcp_notsent_lowat(MAX_UNSENT_BYTES) {
        tracing::debug!(%peer, %error, "cannot set TCP_NOTSENT_LOWAT");
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (stream, peer);
}

fn refuse(peer: SocketAddr, max_connections: usize) {
    tracing::debug!(%peer, max_connections, "too many open connections; closing the new one");
}

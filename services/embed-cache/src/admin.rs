//! The admin listener: `CacheAdmin` over TCP (loopback by default), every call checked
//! against the admin token in constant time.

use std::sync::Arc;

use futures::StreamExt;
use mmserve_protocol::{AdminError, CacheAdmin, CacheStats, ItemInfo, ItemKey};
use tarpc::context::Context;
use tarpc::serde_transport::tcp;
use tarpc::server::{BaseChannel, Channel};
use tarpc::tokio_serde::formats::Bincode;

use crate::CacheService;

pub type AdminListener = tcp::Incoming<
    tarpc::ClientMessage<mmserve_protocol::cache::CacheAdminRequest>,
    tarpc::Response<mmserve_protocol::cache::CacheAdminResponse>,
    Bincode<
        tarpc::ClientMessage<mmserve_protocol::cache::CacheAdminRequest>,
        tarpc::Response<mmserve_protocol::cache::CacheAdminResponse>,
    >,
    fn() -> Bincode<
        tarpc::ClientMessage<mmserve_protocol::cache::CacheAdminRequest>,
        tarpc::Response<mmserve_protocol::cache::CacheAdminResponse>,
    >,
>;

pub async fn bind(addr: &str) -> std::io::Result<AdminListener> {
    let codec: fn() -> Bincode<_, _> = Bincode::default;
    tcp::listen(addr, codec).await
}

#[derive(Clone)]
struct Admin {
    cache: CacheService,
    token: Arc<String>,
}

impl Admin {
    fn check(&self, given: &str) -> Result<(), AdminError> {
        let (a, b) = (self.token.as_bytes(), given.as_bytes());
        // Constant time in the token's contents (its length is not a secret worth hiding).
        let diff = a.len() ^ b.len() | a.iter().zip(b).fold(0usize, |acc, (x, y)| acc | usize::from(x ^ y));
        if diff == 0 { Ok(()) } else { Err(AdminError::Unauthorized) }
    }
}

pub async fn serve(listener: AdminListener, cache: CacheService, token: String) {
    let admin = Admin { cache, token: Arc::new(token) };
    listener
        .filter_map(|r| async move { r.ok() })
        .for_each_concurrent(None, |transport| {
            let admin = admin.clone();
            async move {
                BaseChannel::with_defaults(transport)
                    .execute(admin.serve())
                    .for_each(|response| async move {
                        tokio::spawn(response);
                    })
                    .await;
            }
        })
        .await;
}

impl CacheAdmin for Admin {
    async fn stats(self, _: Context, token: String) -> Result<CacheStats, AdminError> {
        self.check(&token)?;
        Ok(self.cache.stats_now())
    }

    async fn list(self, _: Context, token: String) -> Result<Vec<ItemInfo>, AdminError> {
        self.check(&token)?;
        Ok(self.cache.with_state(|s| s.list()))
    }

    async fn evict(self, _: Context, token: String, digest: ItemKey) -> Result<u64, AdminError> {
        self.check(&token)?;
        self.cache.with_state(|s| s.evict(digest))
    }

    async fn clear(self, _: Context, token: String) -> Result<u64, AdminError> {
        self.check(&token)?;
        Ok(self.cache.with_state(|s| s.clear_unreferenced()))
    }
}

//! Getting a media item's bytes from its URL, safely.
//!
//! - `data:` URLs: base64 only.
//! - `http(s)://`: only for hosts the operator allows. The name is resolved once, every
//!   address is checked (loopback, private, link-local, CGNAT, metadata and other
//!   special ranges are refused unless explicitly allowed), and the connection goes to
//!   the checked address. Redirects are followed by hand, each hop checked the same
//!   way, up to a hop limit. The byte cap is enforced while streaming, and every fetch
//!   has a deadline.
//! - `file://`: only under `--allowed-local-media-path`, after resolving symlinks.

use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use base64::Engine as _;
use futures::StreamExt;

use crate::error::ApiError;

/// What the operator allows.
#[derive(Debug, Clone)]
pub struct FetchPolicy {
    /// Hosts that may be fetched: `example.com` (that host) or `*.example.com` (its subdomains).
    pub allowed_domains: Vec<String>,
    /// Any host (still subject to the address checks).
    pub allow_all_domains: bool,
    /// Also loopback, private, link-local and other special addresses.
    pub allow_private_addresses: bool,
    /// Root under which `file://` URLs may read (canonical).
    pub local_root: Option<PathBuf>,
    pub max_bytes: usize,
    pub timeout: Duration,
    pub max_redirects: usize,
}

fn bad(param: &str, msg: impl Into<String>) -> ApiError {
    ApiError::bad_param(param, msg)
}

/// The bytes behind `url`. `param` names the request field in errors.
pub async fn fetch(url: &str, policy: &FetchPolicy, param: &str) -> Result<Vec<u8>, ApiError> {
    let scheme = url.split_once(':').map(|(s, _)| s.to_ascii_lowercase()).unwrap_or_default();
    let bytes = match scheme.as_str() {
        "data" => data_url(url, policy.max_bytes, param)?,
        "http" | "https" => http(url, policy, param).await?,
        "file" => file(url, policy, param).await?,
        _ => return Err(bad(param, format!("unsupported URL scheme {scheme:?} (use data:, http(s): or file:)"))),
    };
    if bytes.is_empty() {
        return Err(bad(param, "the media item is empty"));
    }
    Ok(bytes)
}

fn too_large(param: &str, max: usize) -> ApiError {
    bad(param, format!("the media item is larger than the limit of {max} bytes (--max-item-bytes)"))
}

/// Decodes a `data:` URL's base64 payload.
pub fn data_url(url: &str, max_bytes: usize, param: &str) -> Result<Vec<u8>, ApiError> {
    let rest = &url["data:".len()..];
    let (meta, payload) = rest.split_once(',').ok_or_else(|| bad(param, "malformed data: URL (no comma)"))?;
    if !meta.ends_with(";base64") {
        return Err(bad(param, "data: URLs must be base64-encoded (`;base64,`)"));
    }
    base64_payload(payload, max_bytes, param)
}

/// Decodes base64 (a `data:` URL's payload, or `input_audio.data`) of at most `max_bytes`.
pub fn base64_payload(payload: &str, max_bytes: usize, param: &str) -> Result<Vec<u8>, ApiError> {
    // Base64 of n bytes is 4n/3 characters: refuse oversized items before decoding.
    if payload.len() / 4 * 3 > max_bytes + 3 {
        return Err(too_large(param, max_bytes));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(payload.trim_end())
        .map_err(|e| bad(param, format!("invalid base64: {e}")))?;
    if bytes.len() > max_bytes {
        return Err(too_large(param, max_bytes));
    }
    Ok(bytes)
}

async fn file(url: &str, policy: &FetchPolicy, param: &str) -> Result<Vec<u8>, ApiError> {
    let Some(root) = &policy.local_root else {
        return Err(bad(param, "file: URLs are not allowed on this server (see --allowed-local-media-path)"));
    };
    let parsed = reqwest::Url::parse(url).map_err(|e| bad(param, format!("invalid file: URL: {e}")))?;
    if parsed.host_str().is_some_and(|h| !h.is_empty() && h != "localhost") {
        return Err(bad(param, "file: URLs must not name a host"));
    }
    let path = parsed.to_file_path().map_err(|_| bad(param, "invalid file: URL path"))?;
    let outside = || bad(param, "the file is outside the allowed local media path");
    // Resolving symlinks first means a link inside the root cannot point outside it.
    let real = tokio::fs::canonicalize(&path).await.map_err(|_| outside())?;
    if !real.starts_with(root) {
        return Err(outside());
    }
    let meta = tokio::fs::metadata(&real).await.map_err(|_| outside())?;
    if !meta.is_file() {
        return Err(bad(param, "the path is not a regular file"));
    }
    if meta.len() > policy.max_bytes as u64 {
        return Err(too_large(param, policy.max_bytes));
    }
    let bytes = tokio::fs::read(&real).await.map_err(|e| bad(param, format!("reading the file: {e}")))?;
    if bytes.len() > policy.max_bytes {
        return Err(too_large(param, policy.max_bytes));
    }
    Ok(bytes)
}

/// Whether an address may be fetched without `--allow-private-media-addresses`.
pub fn is_public(ip: IpAddr) -> bool {
    match ip {
        IpAddr::V4(v4) => is_public_v4(v4),
        IpAddr::V6(v6) => {
            if let Some(v4) = v6.to_ipv4_mapped() {
                return is_public_v4(v4);
            }
            let s = v6.segments();
            !(v6.is_loopback()
                || v6.is_unspecified()
                || (s[..6] == [0; 6]) // IPv4-compatible ::a.b.c.d (deprecated, never public)
                || v6.is_multicast()
                || (s[0] & 0xfe00) == 0xfc00 // unique local (fd00:ec2::254 is AWS metadata)
                || (s[0] & 0xffc0) == 0xfe80 // link-local
                || (s[0] & 0xffc0) == 0xfec0 // site-local
                || (s[0] == 0x64 && s[1] == 0xff9b) // NAT64: an IPv4 address in disguise
                || (s[0] == 0x2002) // 6to4: likewise
                || (s[0] == 0x2001 && s[1] == 0x0db8)) // documentation
        }
    }
}

fn is_public_v4(ip: Ipv4Addr) -> bool {
    let o = ip.octets();
    !(ip.is_loopback()
        || ip.is_private()
        || ip.is_link_local() // 169.254/16, cloud metadata
        || ip.is_unspecified()
        || ip.is_broadcast()
        || ip.is_multicast()
        || o[0] == 0
        || (o[0] == 100 && (o[1] & 0xc0) == 64) // CGNAT 100.64/10
        || (o[0] == 192 && o[1] == 0 && o[2] == 0) // IETF protocol assignments
        || (o[0] == 198 && (o[1] & 0xfe) == 18) // benchmarking 198.18/15
        || o[0] >= 240) // reserved
}

fn host_allowed(host: &str, policy: &FetchPolicy) -> bool {
    if policy.allow_all_domains {
        return true;
    }
    let host = host.trim_end_matches('.').to_ascii_lowercase();
    policy.allowed_domains.iter().any(|d| {
        let d = d.trim().trim_end_matches('.').to_ascii_lowercase();
        match d.strip_prefix("*.") {
            Some(suffix) => host.len() > suffix.len() && host.ends_with(&format!(".{suffix}")),
            None => host == d,
        }
    })
}

/// Resolves `url`'s host once and picks an address that passes the checks.
async fn checked_address(
    url: &reqwest::Url,
    policy: &FetchPolicy,
    timeout: Duration,
    param: &str,
) -> Result<SocketAddr, ApiError> {
    let host = url.host_str().ok_or_else(|| bad(param, "the URL has no host"))?;
    if !host_allowed(host, policy) {
        return Err(bad(
            param,
            format!("fetching media from {host:?} is not allowed on this server (see --allowed-media-domains)"),
        ));
    }
    let port = url.port_or_known_default().ok_or_else(|| bad(param, "the URL has no port"))?;
    let addrs: Vec<SocketAddr> = match url.host() {
        Some(url::Host::Ipv4(ip)) => vec![SocketAddr::new(IpAddr::V4(ip), port)],
        Some(url::Host::Ipv6(ip)) => vec![SocketAddr::new(IpAddr::V6(ip), port)],
        _ => tokio::time::timeout(timeout, tokio::net::lookup_host((host, port)))
            .await
            .map_err(|_| bad(param, format!("resolving {host} timed out")))?
            .map_err(|e| bad(param, format!("resolving {host}: {e}")))?
            .collect(),
    };
    if addrs.is_empty() {
        return Err(bad(param, format!("{host} has no address")));
    }
    if !policy.allow_private_addresses {
        // Refuse if any address is special: a name that resolves to both a public and a
        // private address must not be usable to reach the private one.
        if let Some(a) = addrs.iter().find(|a| !is_public(a.ip())) {
            return Err(bad(
                param,
                format!("{host} resolves to {}, a loopback, private or otherwise reserved address", a.ip()),
            ));
        }
    }
    Ok(addrs[0])
}

async fn http(url: &str, policy: &FetchPolicy, param: &str) -> Result<Vec<u8>, ApiError> {
    let started = Instant::now();
    let remaining = || policy.timeout.saturating_sub(started.elapsed());
    let timed_out = || bad(param, format!("fetching the media took longer than {} s", policy.timeout.as_secs()));
    let mut current = reqwest::Url::parse(url).map_err(|e| bad(param, format!("invalid URL: {e}")))?;
    for _hop in 0..=policy.max_redirects {
        let addr = checked_address(&current, policy, remaining(), param).await?;
        let host = current.host_str().unwrap_or_default().to_string();
        // One client per hop, pinned to the checked address: no second resolution.
        let client = reqwest::Client::builder()
            .redirect(reqwest::redirect::Policy::none())
            .no_proxy()
            .resolve(&host, addr)
            .timeout(remaining())
            .build()
            .map_err(|e| ApiError::Internal(format!("HTTP client: {e}")))?;
        let resp =
            client.get(current.clone()).send().await.map_err(|e| {
                if e.is_timeout() { timed_out() } else { bad(param, format!("fetching {current}: {e}")) }
            })?;
        let status = resp.status();
        if status.is_redirection() {
            let location = resp
                .headers()
                .get(reqwest::header::LOCATION)
                .and_then(|l| l.to_str().ok())
                .ok_or_else(|| bad(param, format!("{current} redirected without a Location")))?;
            current = current.join(location).map_err(|e| bad(param, format!("bad redirect target: {e}")))?;
            if !matches!(current.scheme(), "http" | "https") {
                return Err(bad(param, "redirects may only lead to http(s) URLs"));
            }
            continue;
        }
        if !status.is_success() {
            return Err(bad(param, format!("fetching {current}: HTTP {status}")));
        }
        if resp.content_length().is_some_and(|n| n > policy.max_bytes as u64) {
            return Err(too_large(param, policy.max_bytes));
        }
        let mut body = Vec::new();
        let mut stream = resp.bytes_stream();
        loop {
            let chunk = tokio::time::timeout(remaining(), stream.next()).await.map_err(|_| timed_out())?;
            let Some(chunk) = chunk else { break };
            let chunk = chunk.map_err(|e| {
                if is_timeout(&e) { timed_out() } else { bad(param, format!("reading {current}: {e}")) }
            })?;
            if body.len() + chunk.len() > policy.max_bytes {
                return Err(too_large(param, policy.max_bytes));
            }
            body.extend_from_slice(&chunk);
        }
        return Ok(body);
    }
    Err(bad(param, format!("more than {} redirects", policy.max_redirects)))
}

/// The client's overall deadline shows up as a body error wrapping a timeout somewhere
/// down the source chain.
fn is_timeout(e: &reqwest::Error) -> bool {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(err) = cur {
        if err.downcast_ref::<reqwest::Error>().is_some_and(reqwest::Error::is_timeout)
            || err.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::TimedOut)
        {
            return true;
        }
        cur = err.source();
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_classes() {
        for bad in [
            "127.0.0.1",
            "10.1.2.3",
            "172.16.0.1",
            "192.168.1.1",
            "169.254.169.254",
            "100.64.0.1",
            "0.0.0.0",
            "255.255.255.255",
            "224.0.0.1",
            "240.0.0.1",
            "::1",
            "::",
            "fe80::1",
            "fd00:ec2::254",
            "::ffff:127.0.0.1",
            "64:ff9b::a9fe:a9fe",
            "2002:7f00:1::",
        ] {
            assert!(!is_public(bad.parse().unwrap()), "{bad} must be refused");
        }
        for good in ["93.184.216.34", "8.8.8.8", "2606:4700::1111", "100.128.0.1"] {
            assert!(is_public(good.parse().unwrap()), "{good} is public");
        }
    }

    #[test]
    fn domain_patterns() {
        let p = |d: &[&str]| FetchPolicy {
            allowed_domains: d.iter().map(|s| s.to_string()).collect(),
            allow_all_domains: false,
            allow_private_addresses: false,
            local_root: None,
            max_bytes: 10,
            timeout: Duration::from_secs(1),
            max_redirects: 1,
        };
        assert!(host_allowed("images.example.com", &p(&["*.example.com"])));
        assert!(!host_allowed("example.com", &p(&["*.example.com"])));
        assert!(!host_allowed("evilexample.com", &p(&["*.example.com"])));
        assert!(host_allowed("Example.COM.", &p(&["example.com"])));
        assert!(!host_allowed("example.com.evil.net", &p(&["example.com"])));
        assert!(!host_allowed("x.com", &p(&[])));
    }

    #[test]
    fn data_urls() {
        assert_eq!(data_url("data:image/png;base64,AAEC", 10, "p").unwrap(), vec![0, 1, 2]);
        for bad in ["data:image/png,raw", "data:image/png;base64,@@@", "data:image/png;base64"] {
            assert!(matches!(data_url(bad, 10, "p"), Err(ApiError::BadRequest { .. })), "{bad}");
        }
        assert!(data_url("data:image/png;base64,AAAAAAAAAAAA", 4, "p").is_err(), "over the byte limit");
    }
}

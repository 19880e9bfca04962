//! Getting a media item's bytes from its URL, safely.
//!
//! - `data:` URLs: base64 only.
//! - `http(s)://`: only for hosts the operator allows. The name is resolved once, every
//!   address is checked (loopback, private, link-local, CGNAT, metadata and other
//!   special ranges are refused unless explicitly allowed), and the connection goes to
//!   the checked address. Redirects are followed by hand, each hop checked the same
//!   way, up to a hop limit. The byte cap is enforced while streaming, and every fetch
//!   has a deadline.
//! - `file://`: only under `--allowed-local-media-path`, the path as given (beneath the
//!   canonical root). Opened once by the kernel's beneath-the-root lookup (no `..` or
//!   symlink may lead out, not even one swapped in during the lookup; absolute symlinks are
//!   refused), then checked on the open descriptor: a regular file within the byte cap,
//!   read with the cap and the fetch deadline enforced (see `local`).

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
    let rest = url
        .get(..5)
        .filter(|s| s.eq_ignore_ascii_case("data:"))
        .map(|_| &url[5..])
        .ok_or_else(|| bad(param, "not a data: URL"))?;
    let (meta, payload) = rest.split_once(',').ok_or_else(|| bad(param, "malformed data: URL (no comma)"))?;
    if !meta.ends_with(";base64") {
        return Err(bad(param, "data: URLs must be base64-encoded (`;base64,`)"));
    }
    base64_payload(payload, max_bytes, param)
}

/// The media type a `data:` URL declares (`image/png`), lowercase, without parameters;
/// `None` for a URL of another scheme, a malformed one, or one that declares none
/// (`data:;base64,…`).
pub fn data_url_type(url: &str) -> Option<String> {
    let rest = url.get(..5).filter(|s| s.eq_ignore_ascii_case("data:")).map(|_| &url[5..])?;
    let (meta, _) = rest.split_once(',')?;
    let mime = meta.split(';').next().unwrap_or_default().trim().to_ascii_lowercase();
    (!mime.is_empty()).then_some(mime)
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
    let max = policy.max_bytes;
    let rel = local::relative_beneath(&path, root).ok_or_else(|| local::LocalError::Outside.into_api(param, max))?;
    let root = root.clone();
    // The syscalls block (a slow disk, a network file system): off the event loop, and no
    // longer than the fetch deadline (a stuck read keeps its thread and its place among
    // FILE_READS, never the request, and never more than FILE_READS threads).
    let late = || bad(param, format!("fetching the media took longer than {} s", policy.timeout.as_secs()));
    let read = async {
        let place = FILE_READS.acquire().await.map_err(|_| ApiError::Internal("file reads closed".into()))?;
        tokio::task::spawn_blocking(move || {
            let _place = place;
            local::read_beneath(&root, &rel, max)
        })
        .await
        .map_err(|e| ApiError::Internal(format!("file read task: {e}")))
    };
    match tokio::time::timeout(policy.timeout, read).await {
        Err(_) => Err(late()),
        Ok(Err(e)) => Err(e),
        Ok(Ok(r)) => r.map_err(|e| e.into_api(param, max)),
    }
}

mod local;

/// `file://` reads in progress at most (each on a blocking thread).
static FILE_READS: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(16);

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
    use std::os::unix::fs::OpenOptionsExt;

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
        assert_eq!(data_url_type("data:image/png;base64,AAEC").as_deref(), Some("image/png"));
        assert_eq!(data_url_type("DATA: Audio/WAV ;charset=x;base64,AAEC").as_deref(), Some("audio/wav"));
        for none in ["data:;base64,AAEC", "data:base64", "https://x/y.png", "file:///a.png", "dat"] {
            assert_eq!(data_url_type(none), None, "{none}");
        }
    }

    /// A fresh directory holding `root/` (the allowed path, canonical, with `sub/`) and
    /// `outside/`; removed on drop.
    struct Dirs {
        base: PathBuf,
        root: PathBuf,
        outside: PathBuf,
    }

    impl Drop for Dirs {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.base);
        }
    }

    fn dirs(name: &str) -> Dirs {
        let base = std::env::temp_dir().join(format!("mmserve-fetch-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        std::fs::create_dir_all(base.join("root/sub")).unwrap();
        std::fs::create_dir_all(base.join("outside")).unwrap();
        let (root, outside) = (base.join("root").canonicalize().unwrap(), base.join("outside").canonicalize().unwrap());
        Dirs { base, root, outside }
    }

    fn local(root: &std::path::Path, max_bytes: usize) -> FetchPolicy {
        FetchPolicy {
            allowed_domains: Vec::new(),
            allow_all_domains: false,
            allow_private_addresses: false,
            local_root: Some(root.to_path_buf()),
            max_bytes,
            timeout: Duration::from_secs(2),
            max_redirects: 0,
        }
    }

    fn url(path: &std::path::Path) -> String {
        format!("file://{}", path.display())
    }

    /// Replaces `at` atomically (rename over it) by what `make` creates at a temporary name.
    fn swap(at: &std::path::Path, make: impl FnOnce(&std::path::Path)) {
        let tmp = at.with_extension("tmp");
        let _ = std::fs::remove_file(&tmp);
        make(&tmp);
        std::fs::rename(&tmp, at).unwrap();
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn file_swapped_for_an_outside_symlink_never_leaks() {
        let d = dirs("race-link");
        let (root, outside) = (d.root.clone(), d.outside.clone());
        std::fs::write(outside.join("secret"), b"SECRET").unwrap();
        std::fs::write(root.join("inside"), b"inside").unwrap();
        let target = root.join("x.png");
        std::fs::write(&target, b"inside").unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flipper = {
            let (stop, target, secret) = (stop.clone(), target.clone(), outside.join("secret"));
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    swap(&target, |t| std::os::unix::fs::symlink(&secret, t).unwrap());
                    swap(&target, |t| std::fs::write(t, b"inside").unwrap());
                }
            })
        };
        let (policy, u) = (local(&root, 1 << 20), url(&target));
        let (mut leaked, mut served) = (0, 0);
        for _ in 0..100 {
            let fetches = (0..20).map(|_| fetch(&u, &policy, "image_url"));
            for r in futures::future::join_all(fetches).await {
                match r {
                    Ok(b) if b == b"SECRET" => leaked += 1,
                    Ok(_) => served += 1,
                    Err(_) => {}
                }
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        flipper.join().unwrap();
        assert_eq!(leaked, 0, "{leaked} fetches returned the outside file ({served} the inside one)");
        assert!(served > 0, "the regular file was never served");
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_fifo_swapped_in_never_hangs_a_fetch() {
        let d = dirs("race-fifo");
        let root = d.root.clone();
        let fifo = root.join("sub/fifo");
        let c = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        let target = root.join("x.png");
        std::fs::write(&target, b"inside").unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flipper = {
            let (stop, target, fifo) = (stop.clone(), target.clone(), fifo.clone());
            std::thread::spawn(move || {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    swap(&target, |t| std::fs::hard_link(&fifo, t).unwrap());
                    swap(&target, |t| std::fs::write(t, b"inside").unwrap());
                }
            })
        };
        let (policy, u) = (local(&root, 1 << 20), url(&target));
        let mut hung = 0;
        for _ in 0..50 {
            let fetches = (0..20).map(|_| tokio::time::timeout(Duration::from_secs(5), fetch(&u, &policy, "p")));
            hung += futures::future::join_all(fetches).await.iter().filter(|r| r.is_err()).count();
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        flipper.join().unwrap();
        // A reader stuck on the FIFO gets end-of-file once a writer comes and goes.
        if hung > 0 {
            let _ = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NONBLOCK).open(&fifo);
        }
        assert_eq!(hung, 0, "{hung} fetches hung on a FIFO");
    }

    /// The message of a refusal (a 400).
    fn refusal(r: Result<Vec<u8>, ApiError>) -> String {
        match r {
            Err(e @ ApiError::BadRequest { .. }) => e.to_string(),
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    #[tokio::test]
    async fn files_and_symlinks_that_stay_inside_the_root_are_read() {
        let d = dirs("inside");
        let root = d.root.clone();
        std::fs::write(root.join("cat.png"), b"cat").unwrap();
        std::os::unix::fs::symlink("cat.png", root.join("link.png")).unwrap();
        std::os::unix::fs::symlink("../cat.png", root.join("sub/up.png")).unwrap();
        let policy = local(&root, 100);
        for name in ["cat.png", "link.png", "sub/up.png", "sub/../cat.png", "./sub/./up.png"] {
            let got = fetch(&format!("{}/{name}", url(&root)), &policy, "image_url").await;
            assert_eq!(got.unwrap_or_else(|e| panic!("{name}: {e}")), b"cat", "{name}");
        }
        let missing = refusal(fetch(&url(&root.join("nope.png")), &policy, "p").await);
        assert!(missing.contains("no such file"), "{missing}");
    }

    #[tokio::test]
    async fn links_and_paths_leading_out_of_the_root_are_refused() {
        let d = dirs("outside");
        let (root, outside) = (d.root.clone(), d.outside.clone());
        std::fs::write(outside.join("secret"), b"SECRET").unwrap();
        std::os::unix::fs::symlink(outside.join("secret"), root.join("abs.png")).unwrap();
        std::os::unix::fs::symlink("../outside/secret", root.join("rel.png")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("dir")).unwrap();
        std::os::unix::fs::symlink("/proc/self/root/etc/hostname", root.join("magic.png")).unwrap();
        let policy = local(&root, 100);
        for u in [
            url(&root.join("abs.png")),
            url(&root.join("rel.png")),
            url(&root.join("dir/secret")),
            url(&root.join("magic.png")),
            url(&outside.join("secret")),
            format!("{}/../outside/secret", url(&root)),
            format!("{}/%2e%2e/outside/secret", url(&root)),
        ] {
            let msg = refusal(fetch(&u, &policy, "image_url").await);
            assert!(msg.contains("outside the allowed local media path"), "{u}: {msg}");
        }
    }

    #[tokio::test]
    async fn fifos_directories_and_devices_are_refused_without_blocking() {
        let d = dirs("special");
        let root = d.root.clone();
        let c = std::ffi::CString::new(root.join("pipe.wav").as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: `c` is a NUL-terminated path that outlives the call.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        std::os::unix::fs::symlink("/dev/zero", root.join("zero")).unwrap();
        let policy = local(&root, 100);
        // No writer ever comes: a blocking open or read would wait forever.
        let started = Instant::now();
        let msg = refusal(fetch(&url(&root.join("pipe.wav")), &policy, "audio_url").await);
        assert!(msg.contains("a FIFO"), "{msg}");
        assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
        let msg = refusal(fetch(&url(&root.join("sub")), &policy, "p").await);
        assert!(msg.contains("a directory"), "{msg}");
        // A link to a device is absolute, so it leads out of the root; the walk (below)
        // refuses it as a link.
        let msg = refusal(fetch(&url(&root.join("zero")), &policy, "p").await);
        assert!(msg.contains("outside"), "{msg}");
    }

    #[tokio::test]
    async fn a_file_over_the_cap_is_refused_without_reading_it() {
        let d = dirs("big");
        let root = d.root.clone();
        // 200 MB, sparse: reading it whole would take a while and the memory.
        let big = std::fs::File::create(root.join("big.png")).unwrap();
        big.set_len(200 << 20).unwrap();
        std::fs::write(root.join("fits.png"), [7u8; 100]).unwrap();
        let policy = local(&root, 100);
        let started = Instant::now();
        let msg = refusal(fetch(&url(&root.join("big.png")), &policy, "image_url").await);
        assert!(msg.contains("larger than the limit of 100 bytes (--max-item-bytes)"), "{msg}");
        assert!(started.elapsed() < Duration::from_secs(1), "{:?}", started.elapsed());
        assert_eq!(fetch(&url(&root.join("fits.png")), &policy, "p").await.unwrap(), [7u8; 100]);
        // Past the size check (a file that grows after it, or one that never ends), the read
        // itself stops one byte past the cap.
        let zero = std::fs::File::open("/dev/zero").unwrap();
        assert!(matches!(local::read_capped(zero, 1 << 20, 0), Err(local::LocalError::TooLarge)));
        let fits = std::fs::File::open(root.join("fits.png")).unwrap();
        assert_eq!(local::read_capped(fits, 100, 0).unwrap().len(), 100);
    }

    #[test]
    fn the_fallback_walk_follows_no_symlink_and_no_dotdot() {
        use std::os::fd::AsFd;
        let d = dirs("walk");
        let (root, outside) = (d.root.clone(), d.outside.clone());
        std::fs::write(root.join("sub/cat.png"), b"cat").unwrap();
        std::fs::write(outside.join("secret"), b"SECRET").unwrap();
        std::os::unix::fs::symlink("sub/cat.png", root.join("link.png")).unwrap();
        std::os::unix::fs::symlink("sub", root.join("linkdir")).unwrap();
        std::os::unix::fs::symlink(&outside, root.join("out")).unwrap();
        let dir = std::fs::File::open(&root).unwrap();
        let walk = |rel: &str| local::walk_nofollow(dir.as_fd(), std::path::Path::new(rel));
        let mut cat = std::fs::File::from(walk("sub/cat.png").unwrap());
        let mut got = String::new();
        std::io::Read::read_to_string(&mut cat, &mut got).unwrap();
        assert_eq!(got, "cat");
        for rel in ["link.png", "linkdir/cat.png", "out/secret", "../outside/secret", "sub/../../outside/secret"] {
            let e = local::LocalError::from(walk(rel).unwrap_err());
            assert!(matches!(e, local::LocalError::Outside), "{rel}: {e:?}");
        }
        assert!(matches!(local::LocalError::from(walk("sub/nope").unwrap_err()), local::LocalError::NotFound));
        assert!(matches!(local::LocalError::from(walk("sub/cat.png/x").unwrap_err()), local::LocalError::NotFound));
    }
}

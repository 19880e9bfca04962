//! `mmserve caption`: batch captioning (or transcription) of folders, lists and batch
//! files through the chat API, of an embedded `mmserve serve` (`--model`) or of any
//! OpenAI-compatible server (`--url`).
//!
//! Inputs are listed lazily on a blocking thread into a channel of `--concurrency`
//! places, and at most that many items are in flight: memory is bounded whatever the
//! folder's size. Each finished item is one line of the journal ([`journal`]), written
//! whole, so a run can be killed at any moment and the same command resumes it: items
//! whose record holds the same content digest and settings are skipped. A file that
//! cannot be read, a URL that cannot be fetched, a server error: an error record, and
//! the run goes on; the exit status says whether any item failed.

mod batch;
mod inputs;
mod journal;
mod outputs;
mod progress;
mod request;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use futures::StreamExt;
use mmserve_arena::ByteSize;
use serde_json::{Value, json};

use self::inputs::{Item, Kind, Next, Source};
use self::journal::{Done, Journal};
use self::outputs::Format;
use self::progress::Progress;
use self::request::{Answer, Settings};

#[derive(Debug, clap::Args)]
pub struct CaptionArgs {
    /// Files, folders (walked recursively; media recognised by content) and globs.
    pub paths: Vec<String>,
    /// A file of inputs: one path or http(s) URL a line.
    #[arg(long, env = "MMSERVE_CAPTION_INPUT_LIST")]
    pub input_list: Option<PathBuf>,
    /// A file of inputs: `{"id", "image" | "audio", "prompt"?}` a line.
    #[arg(long, env = "MMSERVE_CAPTION_INPUT_JSONL")]
    pub input_jsonl: Option<PathBuf>,
    /// Requests in the OpenAI batch format (`custom_id`, `method`, `url`, `body`),
    /// answered in the OpenAI batch output format, as `vllm run-batch` does.
    #[arg(long, env = "MMSERVE_CAPTION_BATCH_FILE", conflicts_with_all = ["paths", "input_list", "input_jsonl"])]
    pub batch_file: Option<PathBuf>,
    /// Where the results go (appended; the same command again resumes).
    #[arg(long, env = "MMSERVE_CAPTION_OUT")]
    pub out: PathBuf,
    #[arg(long, env = "MMSERVE_CAPTION_FORMAT", value_enum, default_value = "jsonl")]
    pub format: Format,
    /// The caption's column in `--format metadata`.
    #[arg(long, env = "MMSERVE_CAPTION_METADATA_COLUMN", default_value = "text")]
    pub metadata_column: String,
    /// Model directory of the embedded server.
    #[arg(long, env = "MMSERVE_MODEL", default_value = "assets/models/llava-tiny")]
    pub model: PathBuf,
    /// A running OpenAI-compatible server (`http://host:port` or `…/v1`) instead of an
    /// embedded one.
    #[arg(long, env = "MMSERVE_CAPTION_URL")]
    pub url: Option<String>,
    /// The `model` of the requests (default: the server's first in `/v1/models`).
    #[arg(long, env = "MMSERVE_CAPTION_SERVED_MODEL")]
    pub served_model: Option<String>,
    /// More flags for the embedded `mmserve serve` (e.g. `--serve-arg=--device=cuda`).
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    pub serve_args: Vec<String>,
    /// The user prompt after each item (default: "Describe the image in one sentence.",
    /// or "… the audio …" for audio).
    #[arg(long, env = "MMSERVE_CAPTION_PROMPT")]
    pub prompt: Option<String>,
    /// A system message before each request.
    #[arg(long, env = "MMSERVE_CAPTION_SYSTEM")]
    pub system: Option<String>,
    #[arg(long, env = "MMSERVE_CAPTION_MAX_TOKENS", default_value_t = 64)]
    pub max_tokens: u32,
    #[arg(long, env = "MMSERVE_CAPTION_TEMPERATURE", default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, env = "MMSERVE_CAPTION_TOP_P", default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, env = "MMSERVE_CAPTION_SEED")]
    pub seed: Option<u64>,
    /// Items in flight (and read ahead) at once.
    #[arg(long, env = "MMSERVE_CAPTION_CONCURRENCY", default_value_t = 64)]
    pub concurrency: usize,
    /// Also do again the items whose earlier attempt failed.
    #[arg(long)]
    pub retry_failed: bool,
    /// No progress and no summary.
    #[arg(long)]
    pub quiet: bool,
    /// Largest item read or fetched.
    #[arg(long, env = "MMSERVE_CAPTION_MAX_ITEM_BYTES", default_value = "20MiB")]
    pub max_item_bytes: ByteSize,
    /// Longest wait for one item's answer (or a URL's bytes), in seconds.
    #[arg(long, env = "MMSERVE_CAPTION_REQUEST_TIMEOUT_S", default_value_t = 600)]
    pub request_timeout_s: u64,
}

/// What one item came to.
enum Outcome {
    /// A record for the journal.
    Record(Value),
    /// Done by an earlier run.
    Skipped,
}

/// What every item's task shares.
struct Shared {
    http: reqwest::Client,
    base: String,
    settings: Settings,
    done: HashMap<String, Done>,
    retry_failed: bool,
    max_bytes: u64,
    /// Answers of this run by (digest, settings key), when the settings are
    /// deterministic: a duplicate reuses the first one's.
    answers: Mutex<HashMap<(String, String), Answer>>,
}

pub async fn run(args: CaptionArgs) -> anyhow::Result<()> {
    if args.batch_file.is_none() && args.paths.is_empty() && args.input_list.is_none() && args.input_jsonl.is_none() {
        bail!("nothing to caption: give paths, --input-list, --input-jsonl or --batch-file");
    }
    let http = reqwest::Client::builder().timeout(Duration::from_secs(args.request_timeout_s.max(1))).build()?;
    let (server, base) = match &args.url {
        Some(url) => (None, url.trim_end_matches('/').trim_end_matches("/v1").to_string()),
        None => {
            if !args.quiet {
                eprintln!("mmserve caption: starting a server for {}", args.model.display());
            }
            let s = crate::embedded::OwnServer::start(&args.model, &args.serve_args).await?;
            let url = s.url.clone();
            (Some(s), url)
        }
    };
    let outcome = match &args.batch_file {
        Some(file) => run_batch(&args, file, http, &base).await,
        None => run_items(&args, http, &base).await,
    };
    if let Some(s) = server {
        s.stop().await;
    }
    outcome
}

async fn served_model(http: &reqwest::Client, base: &str, given: Option<&str>) -> anyhow::Result<String> {
    if let Some(m) = given {
        return Ok(m.to_string());
    }
    let v: Value = http.get(format!("{base}/v1/models")).send().await?.json().await.context("/v1/models")?;
    Ok(v["data"][0]["id"].as_str().context("the server lists no model")?.to_string())
}

async fn cache_hits(http: &reqwest::Client, base: &str) -> Option<u64> {
    let text = http.get(format!("{base}/metrics")).send().await.ok()?.text().await.ok()?;
    text.lines().find_map(|l| l.strip_prefix("mmserve_embed_cache_hits_total ")?.trim().parse().ok())
}

/// The journal's path: `--out`, or beside it for `csv`.
fn journal_path(args: &CaptionArgs) -> PathBuf {
    match args.format {
        Format::Csv => {
            let mut p = args.out.as_os_str().to_owned();
            p.push(".journal.jsonl");
            p.into()
        }
        _ => args.out.clone(),
    }
}

/// Lines of `rx`, as a stream.
fn stream_of<T: Send + 'static>(rx: tokio::sync::mpsc::Receiver<T>) -> impl futures::Stream<Item = T> {
    futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|x| (x, rx)) })
}

async fn run_items(args: &CaptionArgs, http: reqwest::Client, base: &str) -> anyhow::Result<()> {
    let mut journal = Journal::open(&journal_path(args), &outputs::key)?;
    let settings = Settings {
        model: served_model(&http, base, args.served_model.as_deref()).await?,
        prompt: args.prompt.clone(),
        system: args.system.clone(),
        max_tokens: args.max_tokens,
        temperature: args.temperature,
        top_p: args.top_p,
        seed: args.seed,
    };
    let hits_before = cache_hits(&http, base).await;
    let shared = Arc::new(Shared {
        http: http.clone(),
        base: base.to_string(),
        settings,
        done: std::mem::take(&mut journal.done),
        retry_failed: args.retry_failed,
        max_bytes: args.max_item_bytes.0,
        answers: Mutex::new(HashMap::new()),
    });
    let concurrency = args.concurrency.max(1);
    let (tx, rx) = tokio::sync::mpsc::channel::<Next>(concurrency);
    let (paths, list, jsonl) = (args.paths.clone(), args.input_list.clone(), args.input_jsonl.clone());
    let lister = tokio::task::spawn_blocking(move || inputs::produce(&paths, list.as_deref(), jsonl.as_deref(), &tx));
    let mut progress = Progress::new(args.quiet);
    let seen = progress.seen();
    let mut results = Box::pin(
        stream_of(rx)
            .inspect(|_| {
                seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            })
            .map(|next| {
                let s = shared.clone();
                async move { process(&s, next).await }
            })
            .buffer_unordered(concurrency),
    );
    let mut interrupted = false;
    let mut lister = std::pin::pin!(lister);
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
                let Some(outcome) = next else { break };
                match outcome {
                    Outcome::Skipped => progress.counts.skipped += 1,
                    Outcome::Record(record) => {
                        journal.append(&record)?;
                        if !record["not_media"].is_null() {
                            progress.counts.not_media += 1;
                        } else if record["error"].is_null() {
                            progress.counts.done += 1;
                            progress.counts.audio_seconds += record["audio_seconds"].as_f64().unwrap_or(0.0);
                            progress.counts.output_tokens += record["completion_tokens"].as_u64().unwrap_or(0);
                            if args.format == Format::Sidecar
                                && let (Some(path), Some(caption)) = (record["path"].as_str(), record["caption"].as_str())
                            {
                                outputs::write_sidecar(std::path::Path::new(path), caption)?;
                            }
                        } else {
                            progress.counts.failed += 1;
                        }
                    }
                }
                progress.finished();
            }
            _ = &mut ctrl_c => {
                interrupted = true;
                break;
            }
        }
    }
    drop(results);
    journal.compact(&outputs::key)?;
    let records = journal.records(&outputs::key)?;
    match args.format {
        Format::Csv => journal::write_atomically(&args.out, outputs::csv(&records).as_bytes())?,
        Format::Metadata => {
            outputs::write_metadata(&records, &args.metadata_column)?;
        }
        Format::Jsonl | Format::Sidecar => {}
    }
    let hits = match (hits_before, cache_hits(&http, base).await) {
        (Some(a), Some(b)) => Some(b.saturating_sub(a)),
        _ => None,
    };
    progress.summary(hits);
    if interrupted {
        bail!("interrupted: the output is valid; run the same command again to resume");
    }
    let failed = progress.counts.failed;
    if failed > 0 {
        bail!("{failed} items failed (see their \"error\"); --retry-failed does them again");
    }
    Ok(())
}

fn record(item: &Item, fields: Value) -> Value {
    let mut r = json!({"id": item.id});
    match &item.source {
        Source::File(p) => r["path"] = json!(p.to_string_lossy()),
        Source::Url(u) => r["url"] = json!(u),
    }
    if let Some(root) = &item.root {
        r["root"] = json!(root.to_string_lossy());
    }
    if let (Value::Object(r), Value::Object(f)) = (&mut r, fields) {
        r.extend(f);
    }
    r
}

fn failure(item: &Item, digest: Option<&str>, settings: Option<&str>, error: impl std::fmt::Display) -> Outcome {
    Outcome::Record(record(
        item,
        json!({"digest": digest, "settings": settings, "caption": null, "error": error.to_string()}),
    ))
}

async fn process(s: &Shared, next: Next) -> Outcome {
    let item = match next {
        Ok(item) => item,
        Err(bad) => {
            if s.done.contains_key(&bad.id) && !s.retry_failed {
                return Outcome::Skipped;
            }
            let item =
                Item { id: bad.id, source: Source::File(PathBuf::new()), prompt: None, root: None, walked: false };
            return failure(&item, None, None, bad.error);
        }
    };
    // An item that could not even be read last time stays failed unless retried.
    if let Some(d) = s.done.get(&item.id)
        && d.digest.is_empty()
        && !d.ok
        && !s.retry_failed
    {
        return Outcome::Skipped;
    }
    let bytes = match &item.source {
        Source::File(p) => request::read_file(p, s.max_bytes).await,
        Source::Url(u) => request::fetch(&s.http, u, s.max_bytes).await,
    };
    let bytes = match bytes {
        Ok(b) => b,
        Err(e) => return failure(&item, None, None, format!("reading: {e}")),
    };
    let digest = request::digest(&bytes);
    let Some(kind) = inputs::sniff(&bytes) else {
        let named_media = match &item.source {
            Source::File(p) => inputs::has_media_extension(p),
            Source::Url(_) => true,
        };
        if item.walked && !named_media {
            if s.done.get(&item.id).is_some_and(|d| d.ok && d.digest == digest) {
                return Outcome::Skipped;
            }
            // A file beside the media of a folder: noted, not a failure.
            let note = "not an image or audio file (by its content)";
            return Outcome::Record(record(
                &item,
                json!({"digest": digest, "caption": null, "not_media": note, "error": null}),
            ));
        }
        return failure(&item, Some(&digest), None, "not an image or audio file (by its content)");
    };
    // A clip's length from its container, where it states one (for the summary's rate).
    let seconds = match kind {
        Kind::Audio(format) => mmserve_media::audio::probe_duration(&bytes, Some(format)).ok().flatten(),
        Kind::Image => None,
    };
    let prompt = s.settings.prompt_for(kind, item.prompt.as_deref()).to_string();
    let key = s.settings.key(&prompt);
    if let Some(d) = s.done.get(&item.id)
        && d.digest == digest
        && d.settings == key
        && (d.ok || !s.retry_failed)
    {
        return Outcome::Skipped;
    }
    let cached = s.settings.deterministic().then(|| lock(&s.answers).get(&(digest.clone(), key.clone())).cloned());
    let answer = match cached.flatten() {
        Some(a) => Ok(a),
        None => {
            let body = s.settings.body(kind, &bytes, &prompt);
            drop(bytes);
            let answer = request::complete(&s.http, &s.base, &body).await;
            if let Ok(a) = &answer
                && s.settings.deterministic()
            {
                lock(&s.answers).insert((digest.clone(), key.clone()), a.clone());
            }
            answer
        }
    };
    let kind_name = match kind {
        Kind::Image => "image",
        Kind::Audio(_) => "audio",
    };
    match answer {
        Ok(a) => Outcome::Record(record(
            &item,
            json!({
                "kind": kind_name, "digest": digest, "settings": key, "caption": a.caption,
                "prompt_tokens": a.prompt_tokens, "completion_tokens": a.completion_tokens,
                "finish_reason": a.finish_reason, "latency_ms": (a.latency.as_secs_f64() * 1e4).round() / 10.0,
                "audio_seconds": seconds, "error": null,
            }),
        )),
        Err(e) => failure(&item, Some(&digest), Some(&key), e),
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

async fn run_batch(
    args: &CaptionArgs,
    file: &std::path::Path,
    http: reqwest::Client,
    base: &str,
) -> anyhow::Result<()> {
    let mut journal = Journal::open(&args.out, &batch::key)?;
    let done = std::mem::take(&mut journal.done);
    let model = served_model(&http, base, args.served_model.as_deref()).await?;
    let concurrency = args.concurrency.max(1);
    let (tx, rx) = tokio::sync::mpsc::channel::<(u64, String)>(concurrency);
    let path = file.to_path_buf();
    let lister = tokio::task::spawn_blocking(move || -> anyhow::Result<()> {
        use std::io::BufRead;
        let f = std::fs::File::open(&path).with_context(|| format!("--batch-file {}", path.display()))?;
        for (n, line) in std::io::BufReader::new(f).lines().enumerate() {
            let line = line.with_context(|| format!("reading {}", path.display()))?;
            if !line.trim().is_empty() && tx.blocking_send((n as u64 + 1, line)).is_err() {
                break;
            }
        }
        Ok(())
    });
    let mut progress = Progress::new(args.quiet);
    let seen = progress.seen();
    let (http2, base2) = (http.clone(), base.to_string());
    let retry = args.retry_failed;
    let mut results = Box::pin(
        stream_of(rx)
            .inspect(|_| {
                seen.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            })
            .map(|(n, line)| {
                let (http, base, model) = (http2.clone(), base2.clone(), model.clone());
                let done = &done;
                async move {
                    let (id, mut body) = match batch::parse_line(&line, n as usize) {
                        Ok(x) => x,
                        Err((id, _)) if done.contains_key(&id) && !retry => return None,
                        Err((id, why)) => return Some(batch::error_line(n, &id, "invalid_request", &why)),
                    };
                    if done.get(&id).is_some_and(|d| d.ok || !retry) {
                        return None;
                    }
                    if body.get("model").is_none() {
                        body["model"] = json!(model);
                    }
                    let answer = http.post(format!("{base}/v1/chat/completions")).json(&body).send().await;
                    Some(match answer {
                        Ok(resp) => {
                            let status = resp.status().as_u16();
                            match resp.json::<Value>().await {
                                Ok(v) => batch::response_line(n, &id, status, v),
                                Err(e) => batch::error_line(n, &id, "bad_response", &e.to_string()),
                            }
                        }
                        Err(e) => batch::error_line(n, &id, "request_failed", &e.to_string()),
                    })
                }
            })
            .buffer_unordered(concurrency),
    );
    let mut interrupted = false;
    let mut ctrl_c = std::pin::pin!(tokio::signal::ctrl_c());
    loop {
        tokio::select! {
            next = results.next() => {
                let Some(line) = next else { break };
                match line {
                    None => progress.counts.skipped += 1,
                    Some(line) => {
                        journal.append(&line)?;
                        if batch::key(&line).is_some_and(|(_, d)| d.ok) {
                            progress.counts.done += 1;
                            progress.counts.output_tokens +=
                                line["response"]["body"]["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                        } else {
                            progress.counts.failed += 1;
                        }
                    }
                }
                progress.finished();
            }
            _ = &mut ctrl_c => {
                interrupted = true;
                break;
            }
        }
    }
    drop(results);
    lister.await.context("reading the batch file")??;
    journal.compact(&batch::key)?;
    progress.summary(None);
    if interrupted {
        bail!("interrupted: the output is valid; run the same command again to resume");
    }
    if progress.counts.failed > 0 {
        bail!(
            "{} requests failed (see their \"error\" or status); --retry-failed does them again",
            progress.counts.failed
        );
    }
    Ok(())
}

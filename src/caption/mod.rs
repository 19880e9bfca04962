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
mod drive;
mod inputs;
mod item;
mod journal;
mod outputs;
mod progress;
mod request;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, bail};
use mmserve_arena::ByteSize;
use serde_json::Value;

use self::drive::{drive, outcome};
use self::inputs::Next;
use self::item::{Shared, process};
use self::journal::Journal;
use self::outputs::Format;
use self::progress::Progress;
use self::request::Settings;

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
    /// Sent as `Authorization: Bearer <key>` (an embedded server asks for it too).
    #[arg(long, env = "MMSERVE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
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

pub async fn run(args: CaptionArgs) -> anyhow::Result<()> {
    if args.batch_file.is_none() && args.paths.is_empty() && args.input_list.is_none() && args.input_jsonl.is_none() {
        bail!("nothing to caption: give paths, --input-list, --input-jsonl or --batch-file");
    }
    let mut headers = reqwest::header::HeaderMap::new();
    if let Some(key) = &args.api_key {
        let mut value = reqwest::header::HeaderValue::from_str(&format!("Bearer {key}")).context("--api-key")?;
        value.set_sensitive(true);
        headers.insert(reqwest::header::AUTHORIZATION, value);
    }
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(args.request_timeout_s.max(1)))
        .default_headers(headers)
        .build()?;
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
        Some(file) => batch::run(&args, file, http, &base).await,
        None => run_items(&args, http, &base).await,
    };
    if let Some(s) = server {
        s.stop().await;
    }
    outcome
}

pub(crate) async fn served_model(http: &reqwest::Client, base: &str, given: Option<&str>) -> anyhow::Result<String> {
    if let Some(m) = given {
        return Ok(m.to_string());
    }
    let v: Value = http.get(format!("{base}/v1/models")).send().await?.json().await.context("/v1/models")?;
    Ok(v["data"][0]["id"].as_str().context("the server lists no model")?.to_string())
}

async fn cache_hits(http: &reqwest::Client, base: &str) -> Option<u64> {
    let text = http.get(format!("{base}/metrics")).send().await.ok()?.text().await.ok()?;
    crate::prom::sample(&text, "mmserve_embed_cache_hits_total").map(|v| v as u64)
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
    let (paths, list, jsonl) = (args.paths.clone(), args.input_list.clone(), args.input_jsonl.clone());
    let list =
        move |tx: tokio::sync::mpsc::Sender<Next>| inputs::produce(&paths, list.as_deref(), jsonl.as_deref(), &tx);
    let work = |next| {
        let s = shared.clone();
        async move { process(&s, next).await }
    };
    let mut progress = Progress::new(args.quiet);
    let sidecars = args.format == Format::Sidecar;
    let interrupted = drive(args.concurrency, list, work, &mut journal, &mut progress, |record, progress| {
        let c = &mut progress.counts;
        if !record["not_media"].is_null() {
            c.not_media += 1;
        } else if record["error"].is_null() {
            c.done += 1;
            c.audio_seconds += record["audio_seconds"].as_f64().unwrap_or(0.0);
            c.output_tokens += record["completion_tokens"].as_u64().unwrap_or(0);
            if sidecars && let (Some(path), Some(caption)) = (record["path"].as_str(), record["caption"].as_str()) {
                outputs::write_sidecar(std::path::Path::new(path), caption)?;
            }
        } else {
            c.failed += 1;
        }
        Ok(())
    })
    .await?;
    let records = journal.compact(&outputs::key)?;
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
    outcome(&progress, interrupted, "items")
}

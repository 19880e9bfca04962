//! `mmserve bench serve`: the serving benchmark people compare servers with, after
//! `vllm bench serve`: any OpenAI-compatible endpoint (or an `mmserve serve` it starts),
//! seeded datasets with images and audio, requests at a Poisson (or gamma) rate under a
//! concurrency cap, and TTFT, TPOT, ITL and end-to-end latency as vLLM reports and saves
//! them. `--sweep` finds the highest rate that meets `--slo`. `bench compare` sets two
//! saved results side by side.

mod client;
mod dataset;
mod report;
mod rng;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use serde_json::{Value, json};

use client::{Endpoint, Outcome, Sender};
use dataset::{BenchRequest, DatasetArgs};

#[derive(Debug, clap::Args)]
pub struct ServeBench {
    /// The server (its root, e.g. http://127.0.0.1:8000); without it, `--serve-model`.
    #[arg(long, env = "MMSERVE_BENCH_BASE_URL")]
    pub base_url: Option<String>,
    /// Start `mmserve serve` on this model directory for the run (on a free port unless
    /// a `--serve-arg=--port=…` says otherwise).
    #[arg(long, env = "MMSERVE_BENCH_SERVE_MODEL")]
    pub serve_model: Option<PathBuf>,
    /// More flags for the started server (e.g. `--serve-arg=--device=cuda`).
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    pub serve_args: Vec<String>,
    /// The model name the requests carry (default: the server's first in `/v1/models`).
    #[arg(long, env = "MMSERVE_BENCH_MODEL")]
    pub model: Option<String>,
    #[arg(long, value_enum, default_value = "chat", env = "MMSERVE_BENCH_ENDPOINT")]
    pub endpoint: Endpoint,
    #[command(flatten)]
    pub dataset: DatasetArgs,
    #[arg(long, default_value_t = 1000, env = "MMSERVE_BENCH_NUM_PROMPTS")]
    pub num_prompts: usize,
    /// Requests per second (a Poisson process, or gamma with `--burstiness`); `inf` sends
    /// them all at once.
    #[arg(long, default_value = "inf", env = "MMSERVE_BENCH_REQUEST_RATE")]
    pub request_rate: f64,
    /// The gaps' gamma shape: 1 is Poisson, below 1 burstier, above 1 steadier.
    #[arg(long, default_value_t = 1.0, env = "MMSERVE_BENCH_BURSTINESS")]
    pub burstiness: f64,
    /// Requests in flight at most (default: no cap).
    #[arg(long, env = "MMSERVE_BENCH_MAX_CONCURRENCY")]
    pub max_concurrency: Option<usize>,
    /// Requests sent (and not measured) before the run.
    #[arg(long, default_value_t = 0, env = "MMSERVE_BENCH_NUM_WARMUPS")]
    pub num_warmups: usize,
    #[arg(long, default_value_t = 0, env = "MMSERVE_BENCH_SEED")]
    pub seed: u64,
    /// Percentiles reported for every metric.
    #[arg(long, alias = "percentiles", value_delimiter = ',', default_value = "99", env = "MMSERVE_BENCH_PERCENTILES")]
    pub metric_percentiles: Vec<f64>,
    /// Ask the server to ignore EOS, so that every request gives its output length.
    #[arg(long, env = "MMSERVE_BENCH_IGNORE_EOS")]
    pub ignore_eos: bool,
    #[arg(long, default_value_t = 0.0, env = "MMSERVE_BENCH_TEMPERATURE")]
    pub temperature: f32,
    /// A JSON object merged into every request body.
    #[arg(long, env = "MMSERVE_BENCH_EXTRA_BODY")]
    pub extra_body: Option<String>,
    /// Whole answers instead of streams (TTFT is then the whole latency).
    #[arg(long, env = "MMSERVE_BENCH_NO_STREAM")]
    pub no_stream: bool,
    /// Each request's limit in seconds.
    #[arg(long, default_value_t = 600, env = "MMSERVE_BENCH_REQUEST_TIMEOUT_S")]
    pub request_timeout_s: u64,
    /// Rates to run one after another (each a full run); with `--slo`, the highest rate
    /// that meets it is reported.
    #[arg(long, value_delimiter = ',', env = "MMSERVE_BENCH_SWEEP")]
    pub sweep: Vec<f64>,
    /// Limits on percentiles in ms, e.g. `ttft_p99=300,tpot_p99=50`.
    #[arg(long, env = "MMSERVE_BENCH_SLO")]
    pub slo: Option<String>,
    /// vLLM's per-request service levels in ms, e.g. `ttft:300 tpot:50` (`ttft`, `tpot`,
    /// `e2el`): requests meeting all of them per second are the `request_goodput`.
    #[arg(long, num_args = 1.., env = "MMSERVE_BENCH_GOODPUT", value_delimiter = ' ')]
    pub goodput: Vec<String>,
    /// Write the result (every setting, every request's timings, the server's
    /// `/version` and `/v1/models`) as JSON; a sweep writes a list.
    #[arg(long, env = "MMSERVE_BENCH_SAVE_RESULT")]
    pub save_result: Option<PathBuf>,
    /// No progress bar.
    #[arg(long, env = "MMSERVE_BENCH_DISABLE_TQDM")]
    pub disable_tqdm: bool,
}

#[derive(Debug, clap::Args)]
pub struct CompareBench {
    /// A saved result (`bench serve --save-result`).
    pub a: PathBuf,
    pub b: PathBuf,
}

pub async fn compare(c: CompareBench) -> anyhow::Result<()> {
    let read = |p: &PathBuf| -> anyhow::Result<Value> {
        let v: Value =
            serde_json::from_str(&std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?)?;
        // A sweep's file: its last run.
        Ok(match v {
            Value::Array(mut runs) => runs.pop().context("an empty sweep")?,
            v => v,
        })
    };
    print!("{}", report::compare(&read(&c.a)?, &read(&c.b)?));
    Ok(())
}

/// Limits on metrics' percentiles: `ttft_p99=300` (ms) is (`p99_ttft_ms`, 99, 300).
fn parse_slo(text: &str) -> anyhow::Result<Vec<(String, f64, f64)>> {
    text.split(',')
        .map(|part| {
            let (k, v) = part.split_once('=').with_context(|| format!("--slo {part:?}: metric_pNN=ms"))?;
            let (metric, p) = k.trim().split_once("_p").with_context(|| format!("--slo {k:?}: metric_pNN"))?;
            if !report::METRICS.contains(&metric) {
                bail!("--slo {k:?}: the metrics are {}", report::METRICS.join(", "));
            }
            let p: f64 = p.parse().with_context(|| format!("--slo {k:?}: a percentile"))?;
            let limit = v.trim().parse().with_context(|| format!("--slo {v:?}"))?;
            Ok((format!("{}_{metric}_ms", report::pkey(p)), p, limit))
        })
        .collect()
}

/// `--goodput`'s `metric:ms` pairs.
fn parse_goodput(parts: &[String]) -> anyhow::Result<Vec<(String, f64)>> {
    parts
        .iter()
        .map(|part| {
            let (k, v) = part.split_once(':').with_context(|| format!("--goodput {part:?}: metric:ms"))?;
            if !["ttft", "tpot", "e2el"].contains(&k) {
                bail!("--goodput {part:?}: the metrics are ttft, tpot and e2el");
            }
            Ok((k.to_string(), v.parse().with_context(|| format!("--goodput {part:?}: milliseconds"))?))
        })
        .collect()
}

pub async fn run(b: ServeBench) -> anyhow::Result<()> {
    let slo = b.slo.as_deref().map(parse_slo).transpose()?;
    let goodput = parse_goodput(&b.goodput)?;
    // The percentiles reported, and those the SLO names.
    let mut percentiles = b.metric_percentiles.clone();
    for (_, p, _) in slo.iter().flatten() {
        if !percentiles.contains(p) {
            percentiles.push(*p);
        }
    }
    let extra = match &b.extra_body {
        None => serde_json::Map::new(),
        Some(t) => serde_json::from_str(t).context("--extra-body must be a JSON object")?,
    };
    // (NaN is refused too: it is above nothing.)
    let above_zero = |x: f64| x.partial_cmp(&0.0) == Some(std::cmp::Ordering::Greater);
    if b.num_prompts == 0 || !above_zero(b.request_rate) || !above_zero(b.burstiness) {
        bail!("--num-prompts, --request-rate and --burstiness must be above 0");
    }
    let server = match (&b.base_url, &b.serve_model) {
        (Some(_), Some(_)) => bail!("--base-url or --serve-model, not both"),
        (None, None) => bail!("--base-url URL or --serve-model DIR"),
        (None, Some(dir)) => Some(crate::embedded::OwnServer::start(dir, &b.serve_args).await?),
        (Some(_), None) => None,
    };
    let base_url = match (&server, &b.base_url) {
        (Some(s), _) => s.url.clone(),
        (None, Some(u)) => u.trim_end_matches('/').trim_end_matches("/v1").to_string(),
        (None, None) => unreachable!(),
    };
    let http = client::http(Duration::from_secs(b.request_timeout_s))?;
    let models = get(&http, &format!("{base_url}/v1/models")).await;
    let model = match &b.model {
        Some(m) => m.clone(),
        None => {
            models["data"][0]["id"].as_str().context("no --model and no model in the server's /v1/models")?.to_string()
        }
    };
    let version = get(&http, &format!("{base_url}/version")).await;
    let sender = Sender {
        http,
        url: base_url.clone(),
        model: model.clone(),
        endpoint: b.endpoint,
        stream: !b.no_stream,
        ignore_eos: b.ignore_eos,
        temperature: b.temperature,
        extra,
    };
    let requests = dataset::build(&b.dataset, b.num_prompts, b.seed)?;
    let digest = dataset::digest(&requests);
    if b.num_warmups > 0 {
        let warm = dataset::build(&b.dataset, b.num_warmups, b.seed ^ 0x5741_524d)?;
        let outcomes = drive(&sender, &warm, f64::INFINITY, 1.0, b.max_concurrency, b.seed, true).await;
        let failed = outcomes.iter().filter(|o| !o.ok()).count();
        if failed > 0 {
            eprintln!("warm-up: {failed} of {} requests failed", warm.len());
        }
    }
    let rates = if b.sweep.is_empty() { vec![b.request_rate] } else { b.sweep.clone() };
    let mut results = Vec::new();
    let mut best: Option<f64> = None;
    for &rate in &rates {
        println!(
            "{} prompts to {model} at {base_url}{}, {} requests/s{}",
            requests.len(),
            b.endpoint.path(),
            if rate.is_finite() { format!("{rate}") } else { "inf".into() },
            b.max_concurrency.map_or(String::new(), |c| format!(", at most {c} at once"))
        );
        let t0 = Instant::now();
        let outcomes = drive(&sender, &requests, rate, b.burstiness, b.max_concurrency, b.seed, b.disable_tqdm).await;
        let duration = t0.elapsed().as_secs_f64();
        let mut m = report::summarize(&outcomes, duration, &percentiles);
        if !goodput.is_empty() {
            let good = outcomes.iter().filter(|o| report::meets(o, &goodput)).count();
            m.insert("request_goodput".into(), json!(good as f64 / duration));
        }
        report::print(&m, &percentiles, b.max_concurrency);
        let settings = json!({
            "date": chrono_like_now(),
            "backend": b.endpoint.backend(),
            "endpoint": b.endpoint.path(),
            "base_url": base_url,
            "model_id": model,
            "dataset_name": format!("{:?}", b.dataset.dataset_name).to_lowercase(),
            "dataset_digest": digest,
            "num_prompts": requests.len(),
            "request_rate": if rate.is_finite() { json!(rate) } else { json!("inf") },
            "burstiness": b.burstiness,
            "max_concurrency": b.max_concurrency,
            "seed": b.seed,
            "ignore_eos": b.ignore_eos,
            "temperature": b.temperature,
            "stream": !b.no_stream,
            "percentiles": percentiles,
            "server": {"version": version, "models": models},
            "goodput": goodput.iter().map(|(k, v)| (k.clone(), json!(v))).collect::<serde_json::Map<_, _>>(),
        });
        for (k, v) in settings.as_object().expect("an object") {
            m.insert(k.clone(), v.clone());
        }
        if let Some(slo) = &slo {
            let met = m["failed"].as_u64() == Some(0)
                && slo.iter().all(|(k, _, limit)| m.get(k).and_then(Value::as_f64).is_some_and(|v| v <= *limit));
            println!("SLO {}: {}", b.slo.as_deref().unwrap_or(""), if met { "met" } else { "missed" });
            m.insert("slo_met".into(), json!(met));
            if met && best.is_none_or(|r| rate > r) {
                best = Some(rate);
            }
        }
        results.push(Value::Object(m));
    }
    if slo.is_some() && rates.len() > 1 {
        match best {
            Some(r) => println!("highest rate meeting the SLO: {r} requests/s"),
            None => println!("no rate met the SLO"),
        }
    }
    if let Some(path) = &b.save_result {
        let v = if b.sweep.is_empty() { results.pop().expect("one run") } else { Value::Array(results) };
        std::fs::write(path, serde_json::to_string_pretty(&v)?)
            .with_context(|| format!("writing {}", path.display()))?;
        println!("saved {}", path.display());
    }
    if let Some(s) = server {
        s.stop().await;
    }
    Ok(())
}

/// GET a JSON document, `null` when the server has none.
async fn get(http: &reqwest::Client, url: &str) -> Value {
    match http.get(url).send().await {
        Ok(r) if r.status().is_success() => r.json().await.unwrap_or(Value::Null),
        _ => Value::Null,
    }
}

/// The time in seconds since the Unix epoch and as UTC `YYYYMMDD-HHMMSS` (vLLM's `date`).
fn chrono_like_now() -> String {
    let secs = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}{m:02}{d:02}-{:02}{:02}{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

/// Sends every request at its arrival time (gaps from Gamma(burstiness, 1 / (rate ·
/// burstiness)), seeded), at most `cap` in flight; returns the outcomes in request order.
async fn drive(
    sender: &Sender,
    requests: &[BenchRequest],
    rate: f64,
    burstiness: f64,
    cap: Option<usize>,
    seed: u64,
    quiet: bool,
) -> Vec<Outcome> {
    let mut rng = rng::Rng::new(seed ^ 0x00A1_1CE5);
    let start = tokio::time::Instant::now();
    let slots = cap.map(|c| Arc::new(tokio::sync::Semaphore::new(c.max(1))));
    let bar = if quiet {
        indicatif::ProgressBar::hidden()
    } else {
        indicatif::ProgressBar::with_draw_target(Some(requests.len() as u64), indicatif::ProgressDrawTarget::stderr())
    };
    let mut at = 0.0f64;
    let mut tasks = Vec::with_capacity(requests.len());
    for r in requests {
        let when = start + Duration::from_secs_f64(at);
        if rate.is_finite() {
            at += rng.gamma(burstiness, 1.0 / (rate * burstiness));
        }
        let (sender, r, slots, bar) = (sender.clone(), r.clone(), slots.clone(), bar.clone());
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep_until(when).await;
            let _slot = match &slots {
                Some(s) => Some(s.clone().acquire_owned().await.expect("never closed")),
                None => None,
            };
            let out = sender.send(&r).await;
            bar.inc(1);
            out
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for t in tasks {
        outcomes.push(
            t.await.unwrap_or_else(|e| Outcome { error: format!("the request's task: {e}"), ..Default::default() }),
        );
    }
    bar.finish_and_clear();
    outcomes
}

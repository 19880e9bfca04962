//! `mmserve bench engine`: the serving engine through a real `mmserve serve` on
//! loopback. Output tokens per second at several concurrencies (fixed prompt and output
//! lengths, EOS ignored, greedy unless `--temperature`), the scheduler's own time per step (from the engine's
//! counters in `/metrics`), and time to first token for a repeated image prompt: first
//! sight, repeats with the prefix cache, and repeats without it (a second server with
//! `--no-prefix-cache`), so the prefix cache's share of the speed-up is its own line.
//! With `--constrained 0,50,100` each throughput run is repeated with that share of its
//! requests under a JSON schema (structured outputs), beside the unconstrained baseline.

use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use futures::StreamExt;
use serde_json::{Value, json};

#[derive(Debug, clap::Args)]
pub struct EngineBench {
    /// Model directory to serve.
    #[arg(long, default_value = "assets/models/llava-tiny")]
    pub model: PathBuf,
    /// Concurrent requests, comma-separated.
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    pub clients: Vec<usize>,
    /// Prompt length in tokens (chat template included).
    #[arg(long, default_value_t = 64)]
    pub prompt_tokens: u64,
    /// Output tokens per request.
    #[arg(long, default_value_t = 64)]
    pub output_tokens: u32,
    /// Requests each client sends, one after another.
    #[arg(long, default_value_t = 3)]
    pub rounds: usize,
    /// Image for the time-to-first-token runs (default: the model directory's input.png).
    #[arg(long)]
    pub image: Option<PathBuf>,
    /// Repeats of the image prompt (0: skip the time-to-first-token runs).
    #[arg(long, default_value_t = 20)]
    pub repeats: usize,
    /// Concurrent image requests of the burst run, each with its own generated image
    /// (0: skip). The burst runs twice: every image new, then all of them again.
    #[arg(long, default_value_t = 0)]
    pub image_clients: usize,
    /// Side of the burst's generated images in pixels.
    #[arg(long, default_value_t = 336)]
    pub image_size: u32,
    /// Sampling temperature of the throughput and burst requests (0: greedy).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Nucleus mass of the throughput and burst requests (with `--temperature`).
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Shares of the throughput requests under a JSON schema, in percent, comma-separated:
    /// each throughput run is repeated at each share.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    pub constrained: Vec<u32>,
    /// More flags for `mmserve serve` (e.g. `--serve-arg=--block-size=32`).
    #[arg(long = "serve-arg", allow_hyphen_values = true)]
    pub serve_args: Vec<String>,
    /// Print JSON lines instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// A `mmserve serve` started for the run; stopped on drop.
struct Client {
    http: reqwest::Client,
    url: String,
}

impl Client {
    /// Every call is bounded: a stuck server fails the bench instead of hanging it.
    fn new(url: &str) -> anyhow::Result<Self> {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(300)).build()?;
        Ok(Client { http, url: url.to_string() })
    }

    async fn chat(&self, body: &Value) -> anyhow::Result<Value> {
        let resp = self.http.post(format!("{}/v1/chat/completions", self.url)).json(body).send().await?;
        let status = resp.status();
        let v: Value = resp.json().await?;
        if !status.is_success() {
            bail!("HTTP {status}: {v}");
        }
        Ok(v)
    }

    /// Seconds until the first streamed token.
    async fn ttft(&self, body: &Value) -> anyhow::Result<f64> {
        Ok(self.stream(body).await?.0)
    }

    /// One streamed request: seconds until the first token, and the output tokens the
    /// usage chunk reports (0 unless `body` asks for it).
    async fn stream(&self, body: &Value) -> anyhow::Result<(f64, u64)> {
        let t0 = Instant::now();
        let resp = self.http.post(format!("{}/v1/chat/completions", self.url)).json(body).send().await?;
        if !resp.status().is_success() {
            bail!("HTTP {}", resp.status());
        }
        let mut stream = resp.bytes_stream();
        let mut seen = String::new();
        let mut first = None;
        while let Some(chunk) = stream.next().await {
            seen.push_str(&String::from_utf8_lossy(&chunk?));
            if first.is_none() && seen.contains("\"token_ids\":[") {
                first = Some(t0.elapsed().as_secs_f64());
            }
        }
        let tokens = seen
            .rsplit_once("\"completion_tokens\":")
            .and_then(|(_, rest)| rest.split(|c: char| !c.is_ascii_digit()).next()?.parse().ok())
            .unwrap_or(0);
        Ok((first.context("no token streamed")?, tokens))
    }

    /// The engine's counters from `/metrics`.
    async fn metrics(&self) -> anyhow::Result<Counters> {
        let text = self.http.get(format!("{}/metrics", self.url)).send().await?.text().await?;
        let get = |name: &str| -> f64 { crate::prom::sample(&text, name).unwrap_or(0.0) };
        Ok(Counters {
            steps: get("mmserve_engine_steps_total"),
            schedule: get("mmserve_engine_schedule_microseconds_total") / 1e6,
            step: get("mmserve_engine_step_microseconds_total") / 1e6,
            prefix_hits: get("mmserve_prefix_cache_hit_tokens_total"),
        })
    }
}

#[derive(Clone, Copy)]
struct Counters {
    steps: f64,
    schedule: f64,
    step: f64,
    prefix_hits: f64,
}

/// The constrained requests' schema: nested objects, arrays of a fixed length, enums,
/// bounded numbers and patterns, long enough that the output runs to `max_tokens`.
fn bench_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "customer": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": 24},
                "tier": {"enum": ["free", "pro", "enterprise"]},
                "since": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}
            }, "required": ["name", "tier", "since"], "additionalProperties": false},
            "items": {"type": "array", "minItems": 12, "maxItems": 12, "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 99},
                    "price": {"type": "number", "minimum": 0, "maximum": 1000},
                    "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["new", "sale", "gift", "bulk"]}}
                },
                "required": ["sku", "qty", "price", "tags"], "additionalProperties": false
            }},
            "paid": {"type": "boolean"}
        },
        "required": ["customer", "items", "paid"],
        "additionalProperties": false
    })
}

/// Whether request `i` of a run is constrained at `share` percent: spread evenly.
fn constrained(i: usize, share: u32) -> bool {
    let share = share.min(100) as usize;
    (i + 1) * share / 100 > i * share / 100
}

fn text_body(model: &str, content: &str, max_tokens: u32, (temperature, top_p): (f32, f32)) -> Value {
    json!({
        "model": model,
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "ignore_eos": true,
    })
}

/// Filler that sets a prompt's length: `words` words, then a suffix.
#[derive(Clone, Copy)]
struct Filler {
    words: usize,
    suffix: &'static str,
}

/// Request `i`'s prompt: a distinct head (so requests share no prefix block) and filler.
fn prompt_text(i: usize, f: Filler) -> String {
    let mut s = format!("Request {i:06}:");
    for w in 0..f.words {
        s.push_str([" red", " blue", " green", " gold"][w % 4]);
    }
    s.push_str(f.suffix);
    s
}

async fn prompt_len(client: &Client, model: &str, f: Filler) -> anyhow::Result<u64> {
    let v = client.chat(&text_body(model, &prompt_text(0, f), 1, (0.0, 1.0))).await?;
    v["usage"]["prompt_tokens"].as_u64().context("usage.prompt_tokens")
}

/// The filler whose prompt has `want` tokens (or the longest below it): a binary search
/// over words, then a scan around it with short suffixes for the last token or two.
async fn calibrate(client: &Client, model: &str, want: u64) -> anyhow::Result<(Filler, u64)> {
    let (mut lo, mut hi) = (0usize, 4 * want as usize + 8);
    while lo < hi {
        let mid = (lo + hi).div_ceil(2);
        if prompt_len(client, model, Filler { words: mid, suffix: "" }).await? <= want {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    let mut best = (Filler { words: 0, suffix: "" }, 0);
    for words in lo.saturating_sub(3)..=lo {
        for suffix in ["", "!", " ok", " ok!", " ok ok"] {
            let f = Filler { words, suffix };
            let got = prompt_len(client, model, f).await?;
            if got == want {
                return Ok((f, got));
            }
            if got < want && got > best.1 {
                best = (f, got);
            }
        }
    }
    Ok(best)
}

/// A PNG of `side`² pixels that differs for every `seed` (a smooth pattern, as a photo's
/// compression would see it, with the seed in its phases).
fn generated_png(seed: usize, side: u32) -> anyhow::Result<Vec<u8>> {
    let img = image::RgbImage::from_fn(side, side, |x, y| {
        let (fx, fy, k) = (x as f32, y as f32, seed as f32);
        let c = |a: f32, b: f32, p: f32| (127.5 + 127.5 * ((fx * a + fy * b) * 0.05 + p).sin()) as u8;
        image::Rgb([c(1.0, 0.3, k), c(0.2, 1.1, k * 1.7), c(0.7, -0.6, k * 2.3)])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png)?;
    Ok(out.into_inner())
}

/// `--image-clients` requests at once, each with its own image: output tokens/s and
/// time to first token (median, p99), first with every image new to the embed cache,
/// then with the same images again (embed cache hits).
async fn image_burst(client: &Client, name: &str, b: &EngineBench, filler: Filler) -> anyhow::Result<()> {
    use base64::Engine;
    let bodies = (0..b.image_clients)
        .map(|i| {
            let png = base64::engine::general_purpose::STANDARD.encode(generated_png(i, b.image_size)?);
            Ok(json!({
                "model": name,
                "messages": [{"role": "user", "content": [
                    {"type": "image_url", "image_url": {"url": format!("data:image/png;base64,{png}")}},
                    {"type": "text", "text": prompt_text(1_000_000 + i, filler)}
                ]}],
                "max_tokens": b.output_tokens, "temperature": b.temperature, "top_p": b.top_p,
                "ignore_eos": true, "stream": true,
                "return_token_ids": true, "stream_options": {"include_usage": true},
            }))
        })
        .collect::<anyhow::Result<Vec<Value>>>()?;
    let mut rows = Vec::new();
    for pass in ["new images", "same images again"] {
        let before = client.metrics().await?;
        let t0 = Instant::now();
        let results = futures::future::join_all(bodies.iter().map(|body| client.stream(body))).await;
        let seconds = t0.elapsed().as_secs_f64();
        let results = results.into_iter().collect::<anyhow::Result<Vec<(f64, u64)>>>()?;
        let hits = client.metrics().await?.prefix_hits - before.prefix_hits;
        let mut ttft: Vec<f64> = results.iter().map(|r| r.0).collect();
        ttft.sort_by(f64::total_cmp);
        let p99 = ttft[((ttft.len() as f64 * 0.99).ceil() as usize).clamp(1, ttft.len()) - 1];
        let tokens: u64 = results.iter().map(|r| r.1).sum();
        rows.push((pass, tokens as f64 / seconds, median(&mut ttft), p99, hits / b.image_clients as f64));
    }
    if b.json {
        for (pass, tps, med, p99, hits) in &rows {
            println!(
                "{}",
                json!({"burst": pass, "clients": b.image_clients, "output_tokens_per_s": tps,
                       "ttft_median_s": med, "ttft_p99_s": p99, "prefix_hit_tokens_per_request": hits})
            );
        }
    } else {
        println!(
            "{} concurrent requests, one {}² image each, {} output tokens:",
            b.image_clients, b.image_size, b.output_tokens
        );
        println!(
            "  {:<18} {:>12} {:>12} {:>12} {:>16}",
            "", "output tok/s", "TTFT median", "TTFT p99", "prefix hits/req"
        );
        for (pass, tps, med, p99, hits) in &rows {
            println!("  {pass:<18} {tps:>12.0} {:>9.1} ms {:>9.1} ms {hits:>16.0}", med * 1e3, p99 * 1e3);
        }
        println!("  TTFT median, hits over misses: {:.2}", rows[1].2 / rows[0].2);
    }
    Ok(())
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

pub async fn run(b: EngineBench) -> anyhow::Result<()> {
    let name = b.model.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_default();
    let server = crate::embedded::OwnServer::start(&b.model, &b.serve_args).await?;
    let client = Client::new(&server.url)?;
    let (filler, prompt_len) = calibrate(&client, &name, b.prompt_tokens).await?;
    if !b.json {
        println!(
            "engine through mmserve serve ({name}): prompt {prompt_len} tokens, output {} tokens, {}, EOS ignored",
            b.output_tokens,
            if b.temperature > 0.0 {
                format!("sampled (temperature {}, top-p {})", b.temperature, b.top_p)
            } else {
                "greedy".to_string()
            }
        );
        println!(
            "{:>8} {:>12} {:>9} {:>12} {:>10} {:>14} {:>10} {:>14} {:>10}",
            "clients",
            "constrained",
            "requests",
            "output tok/s",
            "seconds",
            "step (ms)",
            "vs 0%",
            "schedule (µs)",
            "sched %"
        );
    }
    let mut next = 1usize;
    let mut baseline_step = std::collections::HashMap::new();
    let shares = if b.constrained.is_empty() { vec![0] } else { b.constrained.clone() };
    let schema = json!({"type": "json_schema", "json_schema": {"name": "order", "schema": bench_schema()}});
    if shares.iter().any(|&s| s > 0) {
        // The schema compiled once in the api and the engine before anything is timed.
        let mut warm = text_body(&name, &prompt_text(0, filler), 4, (b.temperature, b.top_p));
        warm["response_format"] = schema.clone();
        client.chat(&warm).await?;
    }
    for (&c, &share) in b.clients.iter().flat_map(|c| shares.iter().map(move |s| (c, s))) {
        let before = client.metrics().await?;
        let t0 = Instant::now();
        let tasks = (0..c).map(|k| {
            let client = &client;
            let (name, schema) = (&name, &schema);
            let first = next + k * b.rounds;
            async move {
                let mut tokens = 0u64;
                for r in 0..b.rounds {
                    let mut body =
                        text_body(name, &prompt_text(first + r, filler), b.output_tokens, (b.temperature, b.top_p));
                    if constrained(k * b.rounds + r, share) {
                        body["response_format"] = schema.clone();
                    }
                    let v = client.chat(&body).await?;
                    tokens += v["usage"]["completion_tokens"].as_u64().unwrap_or(0);
                }
                anyhow::Ok(tokens)
            }
        });
        let results = futures::future::join_all(tasks).await;
        let seconds = t0.elapsed().as_secs_f64();
        next += c * b.rounds;
        let tokens: u64 = results.into_iter().collect::<anyhow::Result<Vec<u64>>>()?.into_iter().sum();
        let after = client.metrics().await?;
        let steps = (after.steps - before.steps).max(1.0);
        let step_ms = (after.step - before.step) / steps * 1e3;
        let sched_us = (after.schedule - before.schedule) / steps * 1e6;
        let tps = tokens as f64 / seconds;
        // Time per output token against the unconstrained run at the same concurrency.
        if share == 0 {
            baseline_step.insert(c, step_ms);
        }
        let ratio = baseline_step.get(&c).map_or(f64::NAN, |base| step_ms / base);
        let sched_share = 100.0 * (after.schedule - before.schedule) / (after.step - before.step).max(1e-12);
        if b.json {
            println!(
                "{}",
                json!({"clients": c, "constrained_percent": share, "requests": c * b.rounds,
                       "output_tokens_per_s": tps, "seconds": seconds, "step_ms": step_ms,
                       "step_vs_unconstrained": ratio, "schedule_us_per_step": sched_us,
                       "schedule_share": sched_share / 100.0})
            );
        } else {
            println!(
                "{c:>8} {:>11}% {:>9} {tps:>12.0} {seconds:>10.2} {step_ms:>14.3} {ratio:>9.3}× {sched_us:>14.1} {sched_share:>9.1}%",
                share,
                c * b.rounds
            );
        }
    }

    if b.image_clients > 0 {
        image_burst(&client, &name, &b, filler).await?;
    }

    if b.repeats == 0 {
        server.stop().await;
        return Ok(());
    }
    // Time to first token for one image prompt seen again and again.
    let image = b.image.clone().unwrap_or_else(|| b.model.join("input.png"));
    let png = std::fs::read(&image).with_context(|| format!("reading {}", image.display()))?;
    let url = {
        use base64::Engine;
        format!("data:image/png;base64,{}", base64::engine::general_purpose::STANDARD.encode(&png))
    };
    let body = json!({
        "model": name,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": prompt_text(0, filler)}
        ]}],
        "max_tokens": 4, "temperature": 0, "ignore_eos": true, "stream": true, "return_token_ids": true,
    });
    let repeats = b.repeats;
    let repeated = |client: Client, body: Value| async move {
        let before = client.metrics().await?;
        let mut t = Vec::new();
        for _ in 0..repeats {
            t.push(client.ttft(&body).await?);
        }
        let hits = client.metrics().await?.prefix_hits - before.prefix_hits;
        anyhow::Ok((median(&mut t), hits / repeats.max(1) as f64))
    };
    let first = client.ttft(&body).await?;
    let (with_prefix, hit_tokens) = repeated(client, body.clone()).await?;
    server.stop().await;
    let mut args = b.serve_args.clone();
    args.push("--no-prefix-cache".into());
    let server = crate::embedded::OwnServer::start(&b.model, &args).await?;
    let client = Client::new(&server.url)?;
    client.ttft(&body).await?; // the image into the embed cache
    let (without_prefix, _) = repeated(client, body).await?;
    server.stop().await;
    if b.json {
        println!(
            "{}",
            json!({"ttft_first_s": first, "ttft_repeat_prefix_cache_s": with_prefix,
                   "ttft_repeat_no_prefix_cache_s": without_prefix, "prefix_hit_tokens_per_request": hit_tokens})
        );
    } else {
        println!("time to first token, one image prompt (median of {} repeats):", b.repeats);
        println!("  first sight (encoder + full prefill)        {:>9.2} ms", first * 1e3);
        println!("  repeated, embed cache hit, no prefix cache  {:>9.2} ms", without_prefix * 1e3);
        println!(
            "  repeated, embed cache hit + prefix cache    {:>9.2} ms  ({hit_tokens:.0} prompt tokens from the prefix cache; {:.2}× faster than without)",
            with_prefix * 1e3,
            without_prefix / with_prefix
        );
    }
    Ok(())
}

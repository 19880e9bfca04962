//! `mmserve bench model`: the model code alone on a device, with no services around it
//! — the figures the GPU work is judged by. For a LLaVA-1.5 directory (real weights, or
//! `--load-format dummy` from `config.json` alone):
//! - decode tokens/s at several batch sizes (greedy, over the paged KV pool), and the
//!   share of the memory roofline: bytes one step must read (weights + KV) over
//!   `--peak-bandwidth`;
//! - prefill tokens/s of one long prompt, and the share of `--peak-flops`;
//! - vision tower + projector images/s at several batch sizes, and the share of peak.
//!
//! For a Qwen2-VL / Qwen2.5-VL directory the same LM figures, and the vision tower (with
//! its merger) at `--image-sizes`: one image of each size alone, and a batch of
//! `--images` images cycling through the sizes (one packed sequence, as the encoder runs
//! them).
//!
//! Times are device-synchronised wall clock, the median of `--repeats` after a warm-up.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use candle_core::{DType, Device, Tensor};
use mmserve_config::{LlamaConfig, ModelConfig, ModelDir};
use mmserve_models::{Llama, LlavaVision, PagedKv, PagedSeq, PlacementArgs, Weights};
use serde_json::json;

#[derive(Debug, clap::Args)]
pub struct ModelBench {
    /// Model directory (LLaVA-1.5, Qwen2-VL or Qwen2.5-VL).
    #[arg(long, default_value = "assets/models/llava-tiny")]
    pub model: PathBuf,
    #[command(flatten)]
    pub placement: PlacementArgs,
    /// Decode batch sizes, comma-separated (0: skip).
    #[arg(long, value_delimiter = ',', default_value = "1,8,64")]
    pub batches: Vec<usize>,
    /// Prompt tokens per sequence before decoding.
    #[arg(long, default_value_t = 512)]
    pub prompt: usize,
    /// Decode steps timed.
    #[arg(long, default_value_t = 128)]
    pub output: usize,
    /// Tokens of the prefill measurement (0: skip).
    #[arg(long, default_value_t = 2048)]
    pub prefill: usize,
    /// Vision batch sizes, comma-separated (0: skip).
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    pub images: Vec<usize>,
    /// Qwen-VL: square image sides, in pixels, comma-separated (each resized as the
    /// preprocessor would: to multiples of 28).
    #[arg(long, value_delimiter = ',', default_value = "448,1024")]
    pub image_sizes: Vec<u32>,
    /// Timed repeats of the prefill and vision measurements.
    #[arg(long, default_value_t = 5)]
    pub repeats: usize,
    /// KV block size.
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Memory bandwidth ceiling, bytes/s (H200: device copy measured at 4.3 TB/s).
    #[arg(long, default_value_t = 4.3e12)]
    pub peak_bandwidth: f64,
    /// Matmul ceiling, FLOP/s (H200: bf16 8192³ measured at 790 TFLOP/s).
    #[arg(long, default_value_t = 790e12)]
    pub peak_flops: f64,
    /// Print JSON lines instead of a table.
    #[arg(long)]
    pub json: bool,
    /// Also run the fixture's reference prompt (the directory's `reference.safetensors`)
    /// and compare the logits and greedy tokens with transformers'.
    #[arg(long)]
    pub parity: bool,
}

fn sync(device: &Device) -> anyhow::Result<()> {
    Ok(device.synchronize()?)
}

/// One untimed run of `f`, then `repeats` timed ones (with none, the one run is timed): the
/// medians of their seconds and of the host's time to issue the work (near the total, the
/// host or a hidden synchronisation is the bound, not the GPU).
fn timed(device: &Device, repeats: usize, f: &mut dyn FnMut() -> anyhow::Result<()>) -> anyhow::Result<(f64, f64)> {
    let (mut times, mut issues) = (Vec::new(), Vec::new());
    for i in 0..=repeats {
        sync(device)?;
        let start = Instant::now();
        f()?;
        let issued = start.elapsed().as_secs_f64();
        sync(device)?;
        if i > 0 || repeats == 0 {
            times.push(start.elapsed().as_secs_f64());
            issues.push(issued);
        }
    }
    Ok((median(times), median(issues)))
}

/// The median; NaN for no samples.
fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Parameters of the LM: (the decoder layers and final norm, the LM head). The
/// embedding table (as large as the head) is only gathered from.
fn lm_params(c: &LlamaConfig) -> (f64, f64) {
    let (h, i, d) = (c.hidden_size as f64, c.intermediate_size as f64, c.head_dim as f64);
    let (nh, nkv) = (c.num_attention_heads as f64, c.num_key_value_heads as f64);
    let attn = h * nh * d * 2.0 + h * nkv * d * 2.0;
    let layer = attn + 3.0 * h * i + 2.0 * h;
    (c.num_hidden_layers as f64 * layer + h, c.vocab_size as f64 * h)
}

pub fn run(b: ModelBench) -> anyhow::Result<()> {
    let dir = ModelDir::open(&b.model)?;
    let t = dir.config.text();
    if matches!(dir.config, ModelConfig::Qwen2Audio(_)) {
        bail!("bench model measures LLaVA-1.5 and Qwen-VL directories");
    }
    let placement = b.placement.resolve(&dir)?;
    let (device, dtype) = (placement.device.clone(), placement.dtype);
    let t0 = Instant::now();
    let weights = placement.weights(&dir)?;
    let llama = Llama::from_weights(&weights, t)?;
    sync(&device)?;
    let load_s = t0.elapsed().as_secs_f64();
    let (layers, head) = lm_params(t);
    let elem = dtype.size_in_bytes() as f64;
    let mut rows = Vec::new();
    let note = |rows: &mut Vec<serde_json::Value>, v: serde_json::Value| {
        if b.json {
            println!("{v}");
        }
        rows.push(v);
    };
    note(
        &mut rows,
        json!({"model": dir.name, "device": format!("{device:?}"), "dtype": format!("{dtype:?}"),
               "load_format": placement.format.to_string(), "lm_params": layers + 2.0 * head, "load_s": load_s}),
    );

    if b.parity {
        let ModelConfig::Llava(cfg) = &dir.config else { bail!("--parity runs LLaVA-1.5 fixtures") };
        let v = parity(&dir, cfg, &weights, &llama)?;
        note(&mut rows, v);
    }

    // Decode.
    let kv_per_token = 2.0 * t.num_hidden_layers as f64 * t.num_key_value_heads as f64 * t.head_dim as f64 * elem;
    for &batch in b.batches.iter().filter(|&&n| n > 0) {
        let per_seq = (b.prompt + b.output + 1).div_ceil(b.block_size);
        let mut kv = PagedKv::new(&llama, batch * per_seq, b.block_size, dtype)?;
        let tables: Vec<Vec<u32>> =
            (0..batch).map(|s| ((s * per_seq) as u32..((s + 1) * per_seq) as u32).collect()).collect();
        // Prefill every sequence (in groups of at most 8192 tokens), keep the last logits.
        let ids: Vec<u32> = (0..b.prompt).map(|i| (i * 7919 % (t.vocab_size - 1)) as u32 + 1).collect();
        let group = (8192 / b.prompt.max(1)).max(1);
        let mut next = Vec::with_capacity(batch);
        for chunk in (0..batch).collect::<Vec<_>>().chunks(group) {
            let embeds = Tensor::cat(&vec![llama.embed_tokens(&ids)?; chunk.len()], 0)?;
            let seqs: Vec<PagedSeq<'_>> = chunk
                .iter()
                .map(|&s| PagedSeq { start: 0, new_tokens: b.prompt, block_table: &tables[s], mrope: None })
                .collect();
            let logits = llama.forward_paged(&embeds, &seqs, &mut kv, false)?;
            next.extend(mmserve_ops::argmax_rows(&logits)?);
        }
        // Step 0 is a warm-up (the first launch of a kernel loads its module); then the
        // timed steps. The host's time to issue a step's work, up to the logits: when it
        // nears the step time, launches (not the GPU) set the pace.
        let (mut start, mut issue) = (Instant::now(), std::time::Duration::ZERO);
        for step in 0..=b.output {
            if step == 1 {
                sync(&device)?;
                (start, issue) = (Instant::now(), std::time::Duration::ZERO);
            }
            let step_start = Instant::now();
            let embeds = llama.embed_tokens(&next)?;
            let seqs: Vec<PagedSeq<'_>> = (0..batch)
                .map(|s| PagedSeq { start: b.prompt + step, new_tokens: 1, block_table: &tables[s], mrope: None })
                .collect();
            let logits = llama.forward_paged(&embeds, &seqs, &mut kv, false)?;
            issue += step_start.elapsed();
            next = mmserve_ops::argmax_rows(&logits)?;
        }
        sync(&device)?;
        let secs = start.elapsed().as_secs_f64();
        let step = secs / b.output as f64;
        let context = b.prompt as f64 + b.output as f64 / 2.0;
        // Read per step: the layers, the LM head, and every sequence's keys and values.
        let bytes = (layers + head) * elem + batch as f64 * context * kv_per_token;
        let ideal = bytes / b.peak_bandwidth;
        note(
            &mut rows,
            json!({"decode_batch": batch, "tokens_per_s": batch as f64 * b.output as f64 / secs,
                   "step_ms": step * 1e3, "roofline_step_ms": ideal * 1e3, "roofline_share": ideal / step,
                   "host_issue_ms": issue.as_secs_f64() * 1e3 / b.output as f64}),
        );
    }

    // Prefill of one long prompt.
    if b.prefill > 0 {
        let blocks = b.prefill.div_ceil(b.block_size);
        let mut kv = PagedKv::new(&llama, blocks, b.block_size, dtype)?;
        let table: Vec<u32> = (0..blocks as u32).collect();
        let ids: Vec<u32> = (0..b.prefill).map(|i| (i * 104729 % (t.vocab_size - 1)) as u32 + 1).collect();
        let embeds = llama.embed_tokens(&ids)?;
        let seqs = [PagedSeq { start: 0, new_tokens: b.prefill, block_table: &table, mrope: None }];
        let (secs, issue) = timed(&device, b.repeats, &mut || {
            llama.forward_paged(&embeds, &seqs, &mut kv, false)?;
            Ok(())
        })?;
        let n = b.prefill as f64;
        let attn = 4.0 * t.num_hidden_layers as f64 * (t.num_attention_heads * t.head_dim) as f64 * n * (n + 1.0) / 2.0;
        // Logits of the last position only.
        let flops = 2.0 * layers * n + 2.0 * head + attn;
        note(
            &mut rows,
            json!({"prefill_tokens": b.prefill, "seconds": secs, "tokens_per_s": n / secs,
                   "host_issue_ms": issue * 1e3,
                   "tflops": flops / secs / 1e12, "peak_share": flops / secs / b.peak_flops}),
        );
    }

    if let ModelConfig::Qwen2Vl(cfg) = &dir.config {
        for row in qwen_vision(&b, &weights, cfg, &device)? {
            note(&mut rows, row);
        }
    }
    let ModelConfig::Llava(cfg) = &dir.config else {
        if !b.json {
            print_table(&rows);
        }
        return Ok(());
    };
    // Vision tower + projector.
    if b.images.iter().any(|&n| n > 0) {
        let vision = LlavaVision::from_weights(&weights, cfg)?;
        let v = &cfg.vision;
        let s = v.image_size;
        let tokens = (v.patches_per_side() * v.patches_per_side() + 1) as f64;
        let layers = vision.tower().num_layers() as f64;
        let (vh, vi, th) = (v.hidden_size as f64, v.intermediate_size as f64, t.hidden_size as f64);
        let per_image = layers * (2.0 * tokens * (4.0 * vh * vh + 2.0 * vh * vi) + 4.0 * tokens * tokens * vh)
            + 2.0 * (tokens - 1.0) * (3.0 * (v.patch_size * v.patch_size) as f64) * vh
            + 2.0 * vision.tokens_per_image() as f64 * (vh * th + th * th);
        for &n in b.images.iter().filter(|&&n| n > 0) {
            let pixels = Tensor::rand(-1f32, 1f32, (n, 3, s, s), &device)?;
            let (secs, issue) = timed(&device, b.repeats, &mut || {
                vision.encode(&pixels)?;
                Ok(())
            })?;
            let flops = per_image * n as f64;
            note(
                &mut rows,
                json!({"vision_batch": n, "images_per_s": n as f64 / secs, "seconds": secs,
                       "host_issue_ms": issue * 1e3,
                       "tflops": flops / secs / 1e12, "peak_share": flops / secs / b.peak_flops}),
            );
        }
    }
    // The vision tower's linear shapes at the largest batch: cuBLAS alone against the
    // epilogue GEMM with the bias, and with the bias and a residual.
    if device.is_cuda()
        && dtype != DType::F32
        && let Some(&n) = b.images.iter().max().filter(|&&n| n > 0)
    {
        for row in gemm_probe(&cfg.vision, n, dtype, &device, placement.kernels)? {
            note(&mut rows, row);
        }
    }
    if !b.json {
        print_table(&rows);
    }
    Ok(())
}

/// Qwen-VL's tower and merger: each of `--image-sizes` alone, then `--images` images
/// cycling through them in one packed sequence. FLOPs count the GEMMs and attention
/// within each image (or window).
fn qwen_vision(
    b: &ModelBench,
    weights: &Weights,
    cfg: &mmserve_config::Qwen2VlConfig,
    device: &Device,
) -> anyhow::Result<Vec<serde_json::Value>> {
    use mmserve_models::{Grid, Qwen2VisionTower};
    let v = &cfg.vision;
    let mut tower = Qwen2VisionTower::from_weights(weights, v)?;
    let factor = (v.patch_size * v.spatial_merge_size) as u32;
    let grid = |side: u32| -> anyhow::Result<Grid> {
        let (h, w) = mmserve_media::qwen2vl::smart_resize(side, side, factor, 56 * 56, 28 * 28 * 1280)?;
        Ok(Grid { t: 1, h: (h / v.patch_size as u32) as usize, w: (w / v.patch_size as u32) as usize })
    };
    let (d, hid, out) = (v.embed_dim as f64, v.mlp_hidden as f64, v.hidden_size as f64);
    let m2 = (v.spatial_merge_size * v.spatial_merge_size) as f64;
    let mlp_gemms = if v.window.is_some() { 3.0 } else { 2.0 };
    let flops = |grids: &[Grid]| -> f64 {
        let mut total = 0.0;
        for g in grids {
            let n = g.h as f64 * g.w as f64;
            let full = 4.0 * n * n * d;
            // Windows of `size` merged patches a side: the attention of a window block.
            let windowed = v.window.as_ref().map(|w| {
                let size = w.window_size / v.spatial_merge_size / v.patch_size * v.spatial_merge_size;
                let (rows, cols) = (g.h.div_ceil(size), g.w.div_ceil(size));
                let mut sum = 0.0;
                for r in 0..rows {
                    for c in 0..cols {
                        let len = (size.min(g.h - r * size) * size.min(g.w - c * size)) as f64;
                        sum += 4.0 * len * len * d;
                    }
                }
                sum
            });
            for i in 0..v.depth {
                let attn = match (&v.window, windowed) {
                    (Some(w), Some(win)) if !w.fullatt_block_indexes.contains(&i) => win,
                    _ => full,
                };
                total += 2.0 * n * (4.0 * d * d + mlp_gemms * d * hid) + attn;
            }
            total += 2.0 * n * v.patch_values() as f64 * d + 2.0 * (n / m2) * (m2 * d * m2 * d + m2 * d * out);
        }
        total
    };
    let mut runs: Vec<(String, Vec<Grid>)> =
        b.image_sizes.iter().map(|&s| Ok((format!("{s}"), vec![grid(s)?]))).collect::<anyhow::Result<_>>()?;
    if let Some(&n) = b.images.iter().max().filter(|&&n| n > 1) {
        let grids: Vec<Grid> =
            (0..n).map(|i| grid(b.image_sizes[i % b.image_sizes.len()])).collect::<anyhow::Result<_>>()?;
        runs.push((format!("mix of {}", b.image_sizes.len()), grids));
    }
    let mut rows = Vec::new();
    for (label, grids) in runs {
        let patches: usize = grids.iter().map(|g| g.t * g.h * g.w).sum();
        let pixels = Tensor::rand(-1f32, 1f32, (patches, v.patch_values()), device)?;
        let (secs, issue) = timed(device, b.repeats, &mut || {
            tower.forward(&pixels, &grids)?;
            Ok(())
        })?;
        let f = flops(&grids);
        rows.push(json!({"vision_batch": grids.len(), "image_side": label, "patches": patches,
                         "images_per_s": grids.len() as f64 / secs, "seconds": secs, "host_issue_ms": issue * 1e3,
                         "tflops": f / secs / 1e12, "peak_share": f / secs / b.peak_flops}));
        if label.starts_with("mix") && device.is_cuda() {
            // The flash path against candle's f32 attention on the same weights and
            // pixels: max |Δ| over the largest output.
            let fast = tower.forward(&pixels, &grids)?.to_dtype(DType::F32)?;
            tower.set_flash_attention(false);
            let plain = tower.forward(&pixels, &grids)?.to_dtype(DType::F32)?;
            tower.set_flash_attention(true);
            let largest = plain.abs()?.max_all()?.to_scalar::<f32>()?;
            let worst = (fast - plain)?.abs()?.max_all()?.to_scalar::<f32>()?;
            rows.push(
                json!({"vision_flash_vs_f32_attention": label, "max_rel_diff": worst / largest.max(f32::MIN_POSITIVE)}),
            );
        }
    }
    Ok(rows)
}

/// Times each of CLIP's four linear shapes for `images` images three ways (microseconds a
/// call, median of 20): the plain GEMM, the GEMM with the bias in its epilogue, and with
/// the bias and a residual.
fn gemm_probe(
    v: &mmserve_config::ClipVisionConfig,
    images: usize,
    dtype: DType,
    device: &Device,
    kernels: mmserve_ops::Kernels,
) -> anyhow::Result<Vec<serde_json::Value>> {
    let mut rows = Vec::new();
    let m = images * (v.patches_per_side() * v.patches_per_side() + 1);
    let (d, i) = (v.hidden_size, v.intermediate_size);
    for (name, n, k) in [("qkv", 3 * d, d), ("out_proj", d, d), ("fc1", i, d), ("fc2", d, i)] {
        let x = Tensor::rand(-1f32, 1f32, (m, k), device)?.to_dtype(dtype)?;
        let w = Tensor::rand(-0.01f32, 0.01f32, (n, k), device)?.to_dtype(dtype)?;
        let bias = Tensor::rand(-1f32, 1f32, n, device)?.to_dtype(dtype)?;
        let r = Tensor::rand(-1f32, 1f32, (m, n), device)?.to_dtype(dtype)?;
        let layer = mmserve_models::Linear::new(w.clone(), Some(bias.clone()), kernels);
        let time = |f: &dyn Fn() -> candle_core::Result<Tensor>| -> anyhow::Result<f64> {
            f()?;
            let mut t = Vec::new();
            for _ in 0..20 {
                sync(device)?;
                let start = Instant::now();
                f()?;
                sync(device)?;
                t.push(start.elapsed().as_secs_f64() * 1e6);
            }
            Ok(median(t))
        };
        let plain = time(&|| x.matmul(&w.t()?))?;
        let bias_us = time(&|| candle_core::Module::forward(&layer, &x))?;
        let both = time(&|| layer.forward_residual(&x, &r))?;
        let flops = 2.0 * (m * n * k) as f64;
        let mut row = json!({"gemm": name, "m": m, "n": n, "k": k, "plain_us": plain, "bias_us": bias_us,
                             "bias_residual_us": both, "plain_tflops": flops / plain / 1e6});
        if name == "fc1" {
            // The bias and an activation: cuBLASLt then the in-place pass, against our
            // warp-specialised GEMM with both in its epilogue (Hopper only; elsewhere the
            // two columns time the same path). gelu_erf's longer epilogue shows how much of
            // the kernel's time its epilogue holds.
            use mmserve_models::Activation;
            for (act, key) in [(Activation::QuickGelu, "quick_gelu"), (Activation::Gelu, "gelu_erf")] {
                for (ours, prefix) in [(false, "lt_"), (true, "ours_")] {
                    let k = mmserve_ops::Kernels { gemm_wgmma: ours, ..kernels };
                    let layer = mmserve_models::Linear::new(w.clone(), Some(bias.clone()), k);
                    row[format!("{prefix}bias_{key}_us")] = json!(time(&|| layer.forward_act(&x, act))?);
                }
            }
        }
        rows.push(row);
    }
    Ok(rows)
}

fn print_table(rows: &[serde_json::Value]) {
    let f = |v: &serde_json::Value, k: &str| v[k].as_f64().unwrap_or(f64::NAN);
    for r in rows {
        // Compute-bound rows: prefill and the vision tower.
        let compute = match (r.get("prefill_tokens"), r.get("vision_batch")) {
            (Some(n), _) => Some((format!("prefill {n:>5} tokens:"), f(r, "tokens_per_s"), "tok/s")),
            (_, Some(n)) => {
                let side = r.get("image_side").and_then(|s| s.as_str()).map(|s| format!(" ({s})")).unwrap_or_default();
                Some((format!("vision  batch {n:>3}{side}:"), f(r, "images_per_s"), "img/s"))
            }
            _ => None,
        };
        if let Some(batch) = r.get("decode_batch") {
            println!(
                "decode  batch {batch:>3}: {:>9.1} tok/s  step {:>8.3} ms  roofline {:>7.3} ms  ({:>5.1}% of roofline)  host issue {:.3} ms",
                f(r, "tokens_per_s"),
                f(r, "step_ms"),
                f(r, "roofline_step_ms"),
                100.0 * f(r, "roofline_share"),
                f(r, "host_issue_ms")
            );
        } else if let Some((label, rate, unit)) = compute {
            println!(
                "{label} {rate:>9.1} {unit}  {:>8.2} ms  {:>7.1} TFLOP/s  ({:>5.1}% of peak){}",
                1e3 * f(r, "seconds"),
                f(r, "tflops"),
                100.0 * f(r, "peak_share"),
                r["host_issue_ms"].as_f64().map(|t| format!("  host issue {t:.2} ms")).unwrap_or_default()
            );
        } else {
            println!("{r}");
        }
    }
}

/// With `--parity` on a fixture directory (it holds `reference.safetensors`): the
/// fixture's image prompt through the vision tower, the merge and the LM on the chosen
/// device and dtype, against transformers' logits; then 8 greedy tokens.
fn parity(
    dir: &ModelDir,
    cfg: &mmserve_config::LlavaConfig,
    weights: &Weights,
    llama: &Llama,
) -> anyhow::Result<serde_json::Value> {
    use mmserve_models::{SeqInput, merge_image_embeddings};
    let device = llama.device().clone();
    let reference = candle_core::safetensors::load(dir.path("reference.safetensors"), &device)?;
    let get = |name: &str| reference.get(name).cloned().with_context(|| format!("reference has no {name}"));
    let ids: Vec<u32> = get("input_ids")?.to_dtype(DType::U32)?.to_vec1()?;
    let vision = LlavaVision::from_weights(weights, cfg)?;
    let image = vision.encode(&get("pixel_values")?)?;
    let embeds = merge_image_embeddings(llama, &ids, cfg.image_token_index, &image)?;
    let mut cache = llama.new_cache();
    let logits = llama.forward(&embeds, &mut [SeqInput { new_tokens: ids.len(), cache: &mut cache }], true)?;
    let want = get("logits")?;
    // Max |Δ| over the largest |logit|, and ‖Δ‖₂ / ‖reference‖₂ (the usual relative error).
    let diff = |a: &Tensor, b: &Tensor| -> anyhow::Result<(f32, f32, f32)> {
        let (a, b) = (a.to_dtype(DType::F32)?, b.to_dtype(DType::F32)?);
        let d = (&a - &b)?;
        let abs = d.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        let scale = b.abs()?.flatten_all()?.max(0)?.to_scalar::<f32>()?;
        let l2 = |t: &Tensor| -> anyhow::Result<f32> { Ok(t.sqr()?.sum_all()?.to_scalar::<f32>()?.sqrt()) };
        Ok((abs, abs / scale.max(f32::MIN_POSITIVE), l2(&d)? / l2(&b)?.max(f32::MIN_POSITIVE)))
    };
    let (abs, rel, l2_rel) = diff(&logits, &want)?;
    // The same prompt through the paged path (our KV-write kernel on a GPU).
    let bs = 16;
    let blocks = ids.len().div_ceil(bs);
    let mut kv = PagedKv::new(llama, blocks, bs, llama.dtype())?;
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let seqs = [PagedSeq { start: 0, new_tokens: ids.len(), block_table: &table, mrope: None }];
    let paged = llama.forward_paged(&embeds, &seqs, &mut kv, true)?;
    let (paged_abs, paged_rel, _) = diff(&paged, &want)?;
    // A step that mixes a short run of queries (the prompt's last 20 tokens, after the
    // rest in an earlier step: the decode kernel on a GPU) with a whole prompt (gathered).
    let tail = 20.min(ids.len() - 1);
    let head = ids.len() - tail;
    let per_seq = ids.len().div_ceil(bs);
    let mut kv = PagedKv::new(llama, 2 * per_seq, bs, llama.dtype())?;
    let (ta, tb): (Vec<u32>, Vec<u32>) =
        ((0..per_seq as u32).collect(), (per_seq as u32..2 * per_seq as u32).rev().collect());
    llama.forward_paged(
        &embeds.narrow(0, 0, head)?,
        &[PagedSeq { start: 0, new_tokens: head, block_table: &ta, mrope: None }],
        &mut kv,
        false,
    )?;
    let both = Tensor::cat(&[embeds.narrow(0, head, tail)?, embeds.clone()], 0)?;
    let seqs = [
        PagedSeq { start: head, new_tokens: tail, block_table: &ta, mrope: None },
        PagedSeq { start: 0, new_tokens: ids.len(), block_table: &tb, mrope: None },
    ];
    let mixed = llama.forward_paged(&both, &seqs, &mut kv, true)?;
    let mixed_want = Tensor::cat(&[want.narrow(0, head, tail)?, want.clone()], 0)?;
    let (_, mixed_rel, _) = diff(&mixed, &mixed_want)?;
    let kernels_differing = mmserve_ops::kv_write::self_test(&device)?;
    let attention_differing = mmserve_ops::paged_attention::self_test(&device)?;
    let mut fused_differing = mmserve_ops::fused::self_test(&device)?;
    fused_differing.extend(mmserve_ops::decoder_fused::self_test(&device)?);
    fused_differing.extend(mmserve_ops::arena_rows::self_test(&device)?);
    fused_differing.extend(mmserve_ops::sampling::self_test(&device)?);
    fused_differing.extend(mmserve_ops::token_mask::self_test(&device)?);
    fused_differing.extend(mmserve_ops::skinny::self_test(&device)?);
    fused_differing.extend(mmserve_ops::flash_attention::self_test(&device)?);
    fused_differing.extend(mmserve_ops::layer_norm::self_test(&device)?);
    fused_differing.extend(mmserve_ops::row_copy::self_test(&device)?);
    fused_differing.extend(mmserve_ops::gemm_epilogue::self_test(&device)?);
    fused_differing.extend(mmserve_ops::patch_embed::self_test(&device)?);
    // Greedy with the KV cache, as generate() runs: contiguous, then paged (our decode
    // attention kernel on a GPU).
    let want_ids: Vec<u32> = get("generated_ids")?.to_dtype(DType::U32)?.to_vec1()?;
    let mut cache = llama.new_cache();
    let mut input = embeds.clone();
    let mut got = Vec::new();
    for _ in 0..want_ids.len() {
        let n = input.dim(0)?;
        let row = llama.forward(&input, &mut [SeqInput { new_tokens: n, cache: &mut cache }], false)?;
        let next = mmserve_ops::argmax_rows(&row)?[0];
        got.push(next);
        input = llama.embed_tokens(&[next])?;
    }
    let blocks = (ids.len() + want_ids.len()).div_ceil(bs);
    let mut kv = PagedKv::new(llama, blocks, bs, llama.dtype())?;
    let table: Vec<u32> = (0..blocks as u32).rev().collect();
    let (mut input, mut start, mut got_paged) = (embeds, 0, Vec::new());
    for _ in 0..want_ids.len() {
        let n = input.dim(0)?;
        let seqs = [PagedSeq { start, new_tokens: n, block_table: &table, mrope: None }];
        let row = llama.forward_paged(&input, &seqs, &mut kv, false)?;
        let next = mmserve_ops::argmax_rows(&row)?[0];
        got_paged.push(next);
        start += n;
        input = llama.embed_tokens(&[next])?;
    }
    Ok(json!({"parity_logits_max_abs": abs, "parity_logits_max_rel": rel, "parity_logits_l2_rel": l2_rel,
              "greedy_identical": got == want_ids,
              "paged_greedy_identical": got_paged == want_ids,
              "paged_logits_max_abs": paged_abs, "paged_logits_max_rel": paged_rel,
              "mixed_step_logits_max_rel": mixed_rel,
              "kv_write_kernel_differs_for": kernels_differing,
              "paged_attention_kernel_differs": attention_differing,
              "fused_kernels_differ": fused_differing,
              "greedy": got, "greedy_reference": want_ids}))
}

//! The paged KV path gives the contiguous path's logits: whole prefill, chunked prefill,
//! decode steps, several sequences in one step, scattered block tables, block copies.

mod common;

use candle_core::{DType, IndexOp, Tensor};
use common::{Reference, argmax, assert_close};
use mmserve_models::{Llama, ModelError, PagedKv, PagedSeq, SeqInput};

const TOL: f32 = 1e-5;

/// Contiguous reference: all prompt logits, then `steps` greedy decode logits.
fn contiguous(llama: &Llama, prompt: &Tensor, steps: usize) -> (Tensor, Vec<(u32, Tensor)>) {
    let mut cache = llama.new_cache();
    let n = prompt.dim(0).unwrap();
    let all = llama.forward(prompt, &mut [SeqInput { new_tokens: n, cache: &mut cache }], true).unwrap();
    let mut last = all.i(n - 1).unwrap();
    let mut out = Vec::new();
    for _ in 0..steps {
        let tok = argmax(&last);
        let e = llama.embed_tokens(&[tok]).unwrap();
        last = llama.forward(&e, &mut [SeqInput { new_tokens: 1, cache: &mut cache }], false).unwrap().i(0).unwrap();
        out.push((tok, last.clone()));
    }
    (all, out)
}

/// A block table that is deliberately not in id order.
fn table(blocks: usize, offset: u32, num_blocks: u32) -> Vec<u32> {
    (0..blocks as u32).map(|i| (offset + i * 7) % num_blocks).collect()
}

fn check_one(llama: &Llama, prompt: &Tensor, block_size: usize, chunk: usize, what: &str) {
    let steps = 4;
    let (all, decodes) = contiguous(llama, prompt, steps);
    let n = prompt.dim(0).unwrap();
    let num_blocks = 64;
    let mut kv = PagedKv::new(llama, num_blocks, block_size, DType::F32).unwrap();
    let t = table((n + steps).div_ceil(block_size), 3, num_blocks as u32);
    let mut start = 0;
    while start < n {
        let len = chunk.min(n - start);
        let seq = PagedSeq { start, new_tokens: len, block_table: &t, mrope: None };
        let logits = llama.forward_paged(&prompt.narrow(0, start, len).unwrap(), &[seq], &mut kv, true).unwrap();
        assert_close(
            &format!("{what}: bs {block_size}, chunk {chunk}, rows {start}.."),
            &logits,
            &all.narrow(0, start, len).unwrap(),
            TOL,
        );
        start += len;
    }
    for (i, (tok, want)) in decodes.iter().enumerate() {
        let e = llama.embed_tokens(&[*tok]).unwrap();
        let seq = PagedSeq { start: n + i, new_tokens: 1, block_table: &t, mrope: None };
        let got = llama.forward_paged(&e, &[seq], &mut kv, false).unwrap();
        assert_close(&format!("{what}: bs {block_size}, decode {i}"), &got.i(0).unwrap(), want, TOL);
    }
}

#[test]
fn paged_matches_contiguous_whole_and_chunked() {
    let (llama, image, text) = common::prompts();
    for block_size in [16, 4] {
        for chunk in [usize::MAX, 7] {
            check_one(&llama, &image, block_size, chunk, "image prompt");
            check_one(&llama, &text, block_size, chunk, "text prompt");
        }
    }
}

#[test]
fn two_sequences_in_one_step_match_single_runs() {
    let (llama, image, text) = common::prompts();
    let (image_all, image_dec) = contiguous(&llama, &image, 1);
    let (text_all, text_dec) = contiguous(&llama, &text, 1);
    let (ni, nt) = (image.dim(0).unwrap(), text.dim(0).unwrap());
    let mut kv = PagedKv::new(&llama, 32, 4, DType::F32).unwrap();
    // Interleaved block ids: the two tables never share a block.
    let ti: Vec<u32> = (0..(ni + 1).div_ceil(4) as u32).map(|i| 2 * i).collect();
    let tt: Vec<u32> = (0..(nt + 1).div_ceil(4) as u32).map(|i| 2 * i + 1).collect();
    let batch = Tensor::cat(&[&image, &text], 0).unwrap();
    let seqs = [
        PagedSeq { start: 0, new_tokens: ni, block_table: &ti, mrope: None },
        PagedSeq { start: 0, new_tokens: nt, block_table: &tt, mrope: None },
    ];
    let logits = llama.forward_paged(&batch, &seqs, &mut kv, false).unwrap();
    assert_close("batched paged prefill, image", &logits.i(0).unwrap(), &image_all.i(ni - 1).unwrap(), TOL);
    assert_close("batched paged prefill, text", &logits.i(1).unwrap(), &text_all.i(nt - 1).unwrap(), TOL);

    let step = llama.embed_tokens(&[image_dec[0].0, text_dec[0].0]).unwrap();
    let seqs = [
        PagedSeq { start: ni, new_tokens: 1, block_table: &ti, mrope: None },
        PagedSeq { start: nt, new_tokens: 1, block_table: &tt, mrope: None },
    ];
    let logits = llama.forward_paged(&step, &seqs, &mut kv, false).unwrap();
    assert_close("batched paged decode, image", &logits.i(0).unwrap(), &image_dec[0].1, TOL);
    assert_close("batched paged decode, text", &logits.i(1).unwrap(), &text_dec[0].1, TOL);
    let expected = Reference::load().tensor("generate_logits").i(1).unwrap();
    assert_close("paged decode vs generate_logits[1]", &logits.i(0).unwrap(), &expected, 1e-4);
}

#[test]
fn shared_prefix_blocks_and_copies() {
    let (llama, _, text) = common::prompts();
    let n = text.dim(0).unwrap();
    let (all, _) = contiguous(&llama, &text, 0);
    let bs = 4;
    let mut kv = PagedKv::new(&llama, 32, bs, DType::F32).unwrap();
    let first: Vec<u32> = (0..n.div_ceil(bs) as u32).collect();
    llama
        .forward_paged(&text, &[PagedSeq { start: 0, new_tokens: n, block_table: &first, mrope: None }], &mut kv, false)
        .unwrap();
    // A second sequence reuses the first full blocks (a prefix-cache hit) and computes
    // only the rest, in fresh blocks; the partly shared block is copied first.
    let cached = (n - 1) / bs * bs;
    let mut second: Vec<u32> = first[..cached / bs].to_vec();
    second.extend((0..(n - cached).div_ceil(bs) as u32).map(|i| 20 + i));
    kv.copy_block(first[cached / bs], second[cached / bs]).unwrap();
    let seq = PagedSeq { start: cached, new_tokens: n - cached, block_table: &second, mrope: None };
    let logits = llama.forward_paged(&text.narrow(0, cached, n - cached).unwrap(), &[seq], &mut kv, true).unwrap();
    assert_close("prefix hit", &logits, &all.narrow(0, cached, n - cached).unwrap(), TOL);
    assert!(kv.copy_block(0, 32).is_err());
}

#[test]
fn bad_paged_steps_are_errors() {
    let (llama, _, text) = common::prompts();
    let n = text.dim(0).unwrap();
    let mut kv = PagedKv::new(&llama, 4, 4, DType::F32).unwrap();
    let short = [0u32, 1];
    let seq = PagedSeq { start: 0, new_tokens: n, block_table: &short, mrope: None };
    assert!(matches!(llama.forward_paged(&text, &[seq], &mut kv, false), Err(ModelError::InvalidInput(_))));
    let bad = [0u32, 9, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3];
    let seq = PagedSeq { start: 0, new_tokens: n, block_table: &bad, mrope: None };
    assert!(matches!(llama.forward_paged(&text, &[seq], &mut kv, false), Err(ModelError::InvalidInput(_))));
    let seq = PagedSeq { start: 0, new_tokens: n - 1, block_table: &bad, mrope: None };
    assert!(llama.forward_paged(&text, &[seq], &mut kv, false).is_err());
    assert!(PagedKv::new(&llama, 0, 4, DType::F32).is_err());
}

//! Batched forward steps: results must not depend on what else is in the batch.

mod common;

use candle_core::{IndexOp, Tensor};
use common::{Reference, argmax, assert_close};
use mmserve_models::{KvCache, Llama, ModelError, SeqInput};

const TOL: f32 = 1e-5;

/// Runs one sequence alone; returns its last logits row.
fn alone(llama: &Llama, embeds: &Tensor, cache: &mut KvCache) -> Tensor {
    let seq = SeqInput { new_tokens: embeds.dim(0).unwrap(), cache };
    llama.forward(embeds, &mut [seq], false).unwrap().i(0).unwrap()
}

#[test]
fn two_prompts_in_one_step_match_single_runs() {
    let (llama, image, text) = common::prompts();
    let (n_image, n_text) = (image.dim(0).unwrap(), text.dim(0).unwrap());
    let (mut image_alone, mut text_alone) = (llama.new_cache(), llama.new_cache());
    let image_last = alone(&llama, &image, &mut image_alone);
    let text_last = alone(&llama, &text, &mut text_alone);

    // Prefill both prompts in one call.
    let (mut image_cache, mut text_cache) = (llama.new_cache(), llama.new_cache());
    let batch = Tensor::cat(&[&image, &text], 0).unwrap();
    let mut seqs = [
        SeqInput { new_tokens: n_image, cache: &mut image_cache },
        SeqInput { new_tokens: n_text, cache: &mut text_cache },
    ];
    let logits = llama.forward(&batch, &mut seqs, false).unwrap();
    assert_eq!(logits.dims(), &[2, 1024]);
    assert_close("batched prefill, image prompt", &logits.i(0).unwrap(), &image_last, TOL);
    assert_close("batched prefill, text prompt", &logits.i(1).unwrap(), &text_last, TOL);
    assert_eq!((image_cache.len(), text_cache.len()), (n_image, n_text));

    // The same step with every row's logits: rows split back per sequence.
    let (mut c1, mut c2) = (llama.new_cache(), llama.new_cache());
    let mut seqs = [SeqInput { new_tokens: n_image, cache: &mut c1 }, SeqInput { new_tokens: n_text, cache: &mut c2 }];
    let all = llama.forward(&batch, &mut seqs, true).unwrap();
    assert_eq!(all.dims(), &[n_image + n_text, 1024]);
    let r = Reference::load();
    assert_close("batched all logits, image rows", &all.narrow(0, 0, n_image).unwrap(), &r.tensor("logits"), 1e-4);
    assert_close(
        "batched all logits, text rows",
        &all.narrow(0, n_image, n_text).unwrap(),
        &r.tensor("text_only_logits"),
        1e-4,
    );

    // One decode step for both, against each sequence decoding alone.
    let next = [argmax(&image_last), argmax(&text_last)];
    let step = llama.embed_tokens(&next).unwrap();
    let image_next = alone(&llama, &step.i(0..1).unwrap(), &mut image_alone);
    let text_next = alone(&llama, &step.i(1..2).unwrap(), &mut text_alone);
    let mut seqs =
        [SeqInput { new_tokens: 1, cache: &mut image_cache }, SeqInput { new_tokens: 1, cache: &mut text_cache }];
    let logits = llama.forward(&step, &mut seqs, false).unwrap();
    assert_close("batched decode, image prompt", &logits.i(0).unwrap(), &image_next, TOL);
    assert_close("batched decode, text prompt", &logits.i(1).unwrap(), &text_next, TOL);
    let expected = Reference::load().tensor("generate_logits").i(1).unwrap();
    assert_close("batched decode vs generate_logits[1]", &logits.i(0).unwrap(), &expected, 1e-4);
    assert_eq!((image_cache.len(), text_cache.len()), (n_image + 1, n_text + 1));
}

#[test]
fn prefill_and_decode_mixed_in_one_step() {
    let (llama, image, text) = common::prompts();
    let mut image_cache = llama.new_cache();
    let image_last = alone(&llama, &image, &mut image_cache);
    let text_last = alone(&llama, &text, &mut llama.new_cache());
    let next = llama.embed_tokens(&[argmax(&image_last)]).unwrap();
    let image_next = alone(&llama, &next, &mut image_cache.clone());

    // The text prompt prefills while the image sequence decodes, text rows first.
    let mut text_cache = llama.new_cache();
    let batch = Tensor::cat(&[&text, &next], 0).unwrap();
    let mut seqs = [
        SeqInput { new_tokens: text.dim(0).unwrap(), cache: &mut text_cache },
        SeqInput { new_tokens: 1, cache: &mut image_cache },
    ];
    let logits = llama.forward(&batch, &mut seqs, false).unwrap();
    assert_close("mixed step, text prefill", &logits.i(0).unwrap(), &text_last, TOL);
    assert_close("mixed step, image decode", &logits.i(1).unwrap(), &image_next, TOL);
}

#[test]
fn bad_steps_are_errors_and_leave_caches_alone() {
    let (llama, _, text) = common::prompts();
    let mut cache = llama.new_cache();
    let n = text.dim(0).unwrap();
    let mut seqs = [SeqInput { new_tokens: n - 1, cache: &mut cache }];
    let err = llama.forward(&text, &mut seqs, false).unwrap_err();
    assert!(matches!(err, ModelError::InvalidInput(_)), "{err}");
    let mut seqs = [SeqInput { new_tokens: 0, cache: &mut cache }];
    assert!(llama.forward(&text.i(0..0).unwrap(), &mut seqs, false).is_err());
    assert!(cache.is_empty());
    assert!(matches!(llama.embed_tokens(&[1024]), Err(ModelError::InvalidInput(_))));
    // The cache is still usable.
    let mut seqs = [SeqInput { new_tokens: n, cache: &mut cache }];
    llama.forward(&text, &mut seqs, false).unwrap();
    assert_eq!(cache.len(), n);
}

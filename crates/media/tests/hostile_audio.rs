//! Audio built to cost the server: absurd sample rates, headers that claim more than the file
//! holds, clips longer than the model hears. Each is refused or bounded before the expensive
//! step (allocation, resampling), which a counting allocator checks.

#[path = "support/wav.rs"]
mod wav;

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::time::Instant;

use mmserve_media::audio::{AudioError, AudioLimits, TARGET_SAMPLE_RATE, decode_audio, probe_duration};
use wav::wav16;

/// Counts the bytes live on each thread, and their peak, so that a test can bound what one
/// call allocated (tests run on threads of their own).
struct Counting;

thread_local! {
    static LIVE: Cell<usize> = const { Cell::new(0) };
    static PEAK: Cell<usize> = const { Cell::new(0) };
}

fn track(grow: usize, shrink: usize) {
    // `try_with`: the allocator also runs while thread-locals are torn down.
    let _ = LIVE.try_with(|live| {
        let now = (live.get() + grow).saturating_sub(shrink);
        live.set(now);
        let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
    });
}

// SAFETY: every call is forwarded unchanged to the system allocator; the bookkeeping only
// touches const-initialised thread-locals, which never allocate.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        track(layout.size(), 0);
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        track(0, layout.size());
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        track(new_size, layout.size());
        // SAFETY: the caller's contract, forwarded.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// The most bytes live at once on this thread while `f` runs, above what was live before.
fn peak_bytes<T>(f: impl FnOnce() -> T) -> (T, usize) {
    let base = LIVE.with(Cell::get);
    PEAK.with(|p| p.set(base));
    let out = f();
    (out, PEAK.with(Cell::get) - base)
}

/// A sweep with some noise: every frequency band of the resampler carries signal.
fn tone(n: usize, rate: u32) -> Vec<i16> {
    let mut seed = 0x2545_f491_u32;
    (0..n)
        .map(|i| {
            seed ^= seed << 13;
            seed ^= seed >> 17;
            seed ^= seed << 5;
            let t = i as f64 / f64::from(rate);
            let sweep = (t * (200.0 + 40.0 * t) * std::f64::consts::TAU).sin() * 12_000.0;
            (sweep + f64::from(seed % 2000) - 1000.0) as i16
        })
        .collect()
}

#[test]
fn sample_rates_below_the_minimum_are_refused_naming_rate_and_minimum() {
    let lim = AudioLimits::default();
    assert_eq!(lim.min_sample_rate, 4000);
    // 600 samples at 1 Hz would resample to 600 s of 16 kHz audio: 1.2 KB in, 38 MB out.
    for rate in [1, 0, 3999] {
        let wav = wav16(&tone(600, 8000), rate, None);
        let started = Instant::now();
        let err = decode_audio(&wav, Some("wav"), &lim).unwrap_err();
        assert_eq!(err, AudioError::SampleRateTooLow { rate, min_rate: 4000 }, "{rate} Hz");
        let msg = err.to_string();
        assert!(msg.contains(&format!("{rate} Hz")) && msg.contains("4000 Hz"), "{msg}");
        assert!(started.elapsed().as_secs_f64() < 1.0, "{rate} Hz took {:?}", started.elapsed());
    }
    let custom = AudioLimits { min_sample_rate: 8000, ..AudioLimits::default() };
    let err = decode_audio(&wav16(&tone(600, 4000), 4000, None), None, &custom).unwrap_err();
    assert_eq!(err, AudioError::SampleRateTooLow { rate: 4000, min_rate: 8000 });
}

#[test]
fn rates_from_the_minimum_up_still_decode() {
    for rate in [4000, 8000] {
        let n = rate as usize * 3 / 2;
        let w = decode_audio(&wav16(&tone(n, rate), rate, None), Some("wav"), &AudioLimits::default())
            .unwrap_or_else(|e| panic!("{rate} Hz: {e}"));
        assert_eq!((w.source_rate, w.sample_rate), (rate, TARGET_SAMPLE_RATE));
        assert_eq!(w.samples.len(), (n * 16_000).div_ceil(rate as usize), "{rate} Hz");
    }
}

#[test]
fn a_header_claiming_a_huge_length_does_not_allocate_it() {
    // 192 kHz, a data chunk claiming 590 s (226 MB, within the 600 s limit), 1 s present.
    let rate = 192_000;
    let claimed = 590 * rate * 2;
    let wav = wav16(&tone(rate as usize, rate), rate, Some(claimed));
    assert_eq!(probe_duration(&wav, None), Ok(Some(590.0)));
    let (r, peak) = peak_bytes(|| decode_audio(&wav, None, &AudioLimits::default()));
    assert!(matches!(r, Err(AudioError::Undecodable(ref m)) if m.contains("truncated")), "{r:?}");
    assert!(peak < 32 << 20, "{} MB allocated for a {} KB file", peak >> 20, wav.len() >> 10);
}

#[test]
fn without_a_stated_length_the_limit_holds_past_the_kept_window() {
    // A FLAC whose STREAMINFO leaves the total at 0 ("unknown") states no length: it is decoded
    // on past the window to enforce the limit, and refused without being resampled.
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/audio/pcm16.flac");
    let mut flac = std::fs::read(path).unwrap();
    flac[21] &= 0xf0;
    flac[22..26].fill(0);
    assert_eq!(probe_duration(&flac, None), Ok(None));
    let lim = AudioLimits { max_seconds: 1.0, keep_samples: Some(8000), ..AudioLimits::default() };
    assert_eq!(decode_audio(&flac, None, &lim), Err(AudioError::TooLong { seconds: None, max_seconds: 1.0 }));
    let lim = AudioLimits { keep_samples: Some(8000), ..AudioLimits::default() };
    assert_eq!(decode_audio(&flac, None, &lim).unwrap().samples.len(), 8000);
}

#[test]
fn only_the_kept_window_is_resampled_bit_for_bit() {
    // 40 s clips, of which the model hears 30 s: the kept samples equal those of the whole
    // clip resampled, at rates with a short and with a very long resampler block.
    let keep = 30 * TARGET_SAMPLE_RATE as usize;
    // `u32::MAX`: a streamed WAV, whose length the decoder takes from the file's size.
    for (rate, stated) in [(8000, None), (44_100, None), (44_101, None), (48_000, Some(u32::MAX))] {
        let wav = wav16(&tone(40 * rate as usize, rate), rate, stated);
        let whole = decode_audio(&wav, None, &AudioLimits::default()).unwrap();
        let lim = AudioLimits { keep_samples: Some(keep), ..AudioLimits::default() };
        let kept = decode_audio(&wav, None, &lim).unwrap();
        assert_eq!(kept.samples.len(), keep, "{rate} Hz");
        assert!(kept.samples == whole.samples[..keep], "{rate} Hz, stated {stated:?}: samples differ");
    }
    // 8-bit PCM goes through the decoder rather than the 16-bit fast path.
    let rate = 22_050;
    let u8s: Vec<u8> = tone(40 * rate as usize, rate).iter().map(|&s| ((s >> 8) + 128) as u8).collect();
    let mut wav = wav16(&[], rate, Some(u8s.len() as u32));
    wav[32..36].copy_from_slice(&(1u32 | 8 << 16).to_le_bytes()); // block align 1, 8 bits
    wav[28..32].copy_from_slice(&rate.to_le_bytes()); // bytes per second
    wav.extend(&u8s);
    let whole = decode_audio(&wav, None, &AudioLimits::default()).unwrap();
    let lim = AudioLimits { keep_samples: Some(keep), ..AudioLimits::default() };
    assert!(decode_audio(&wav, None, &lim).unwrap().samples == whole.samples[..keep], "8-bit");

    // A clip shorter than the window is whole.
    let wav = wav16(&tone(16_000, 16_000), 16_000, None);
    let lim = AudioLimits { keep_samples: Some(keep), ..AudioLimits::default() };
    assert_eq!(decode_audio(&wav, None, &lim).unwrap().samples.len(), 16_000);
}

#[test]
fn a_long_clip_with_a_stated_length_is_decoded_only_as_far_as_kept() {
    // 590 s at 4 kHz, all present (4.7 MB): whole, its samples would take 9.4 MB as f32 and
    // 38 MB resampled; with a 30 s window, a fraction of that.
    let rate = 4000;
    let wav = wav16(&tone(590 * rate as usize, rate), rate, None);
    let lim = AudioLimits { keep_samples: Some(30 * TARGET_SAMPLE_RATE as usize), ..AudioLimits::default() };
    let (w, peak) = peak_bytes(|| decode_audio(&wav, None, &lim).unwrap());
    assert_eq!(w.samples.len(), 30 * TARGET_SAMPLE_RATE as usize);
    assert!(peak < 6 << 20, "{} MB allocated", peak >> 20);
}

/// A WAV header with no channels or absurdly many is refused, naming the count (the WAV
/// reader's own arithmetic on it overflows).
#[test]
fn wav_channel_counts_out_of_range_are_refused() {
    for channels in [0u16, 65, u16::MAX] {
        let mut wav = wav16(&tone(400, 8000), 8000, None);
        wav[22..24].copy_from_slice(&channels.to_le_bytes());
        match decode_audio(&wav, None, &AudioLimits::default()) {
            Err(AudioError::Undecodable(m)) => assert!(m.contains(&format!("{channels} channels")), "{m}"),
            other => panic!("{channels} channels: {other:?}"),
        }
    }
}

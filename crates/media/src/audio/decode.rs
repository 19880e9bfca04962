//! Bytes → 16 kHz mono `f32`, like transformers' soundfile backend (`soundfile` read as `float32`,
//! channels averaged, then `soxr` "HQ" resampling to `ceil(n · 16000 / rate)` samples).
//!
//! Integer PCM is scaled the way libsndfile does it: `i16 / 32768`, `i24 / 2^23`, `i32 / 2^31`,
//! `(u8 − 128) / 128`; float PCM passes through. Channels are averaged in `f32` (`(l + r) / 2`
//! for stereo, as numpy's `mean(axis=0)`). Other rates go through rubato's FFT resampler (a
//! BlackmanHarris²-windowed sinc anti-aliasing filter applied in the frequency domain; rubato's
//! fixed-ratio high-quality mode) with the delay trimmed, to exactly `ceil(n · 16000 / rate)`
//! samples. It is not soxr: resampled audio agrees with transformers' to about 1e-3, not bit for
//! bit.
//!
//! Stricter than transformers where a server should be: a PCM (WAV) or FLAC file that ends before
//! the length its header states, or any file cut inside a packet, is refused as truncated; a
//! corrupt packet is an error rather than skipped; the length limit is checked on the header
//! before any decoding when the container states a length, and counted on the source's samples
//! while decoding otherwise, so nothing longer than the limit is ever resampled. Sample rates
//! below [`AudioLimits::min_sample_rate`] are refused: resampling multiplies the sample count by
//! 16 000 / rate, and a 1 Hz header would turn a 1 KB file into minutes of audio. An MP3 cut
//! between frames decodes to what is there (as with every player).
//!
//! With [`AudioLimits::keep_samples`] (what the model hears), only that window and the
//! resampler's context after it are held and resampled, and a clip whose container states its
//! length is not decoded past it.
//!
//! Format notes: MP3 and Vorbis decode like libsndfile's mpg123/libvorbis (to ~1e-6, same
//! lengths, LAME gapless info applied). M4A/MP4: AAC-LC; symphonia ignores MP4 edit lists, so the
//! encoder priming (typically 1024 frames) is trimmed here from the track's single-entry `elst`.
//! Raw ADTS `.aac` has no such information and keeps its priming. Opus, ALAC, WMA, AIFF, CAF,
//! WebM/Matroska and others are refused with their name. A streamed WAV (data length 0xFFFFFFFF)
//! is read to the end of the file.

use std::borrow::Cow;
use std::io::Cursor;

use rubato::audioadapter_buffers::direct::InterleavedSlice;
use rubato::{Fft, FixedSync, Resampler, WindowFunction};
use symphonia::core::codecs::CodecParameters;
use symphonia::core::codecs::audio::well_known as codec;
use symphonia::core::codecs::audio::{AudioCodecId, AudioCodecParameters, AudioDecoderOptions, CODEC_ID_NULL_AUDIO};
use symphonia::core::errors::Error as SymError;
use symphonia::core::formats::probe::Hint;
use symphonia::core::formats::well_known::FORMAT_ID_ISOMP4;
use symphonia::core::formats::{FormatOptions, FormatReader, Track, TrackType};
use symphonia::core::io::MediaSourceStream;
use symphonia::core::meta::MetadataOptions;

use super::AudioError;
use super::error::MAX_SAMPLE;

/// The rate every decoded [`Waveform`] has: what Whisper-style feature extractors expect.
pub const TARGET_SAMPLE_RATE: u32 = 16_000;

/// Bounds on what [`decode_audio`] accepts.
#[derive(Debug, Clone, PartialEq)]
pub struct AudioLimits {
    /// Longest accepted clip, in seconds (default 600). Checked on the header when the container
    /// states a length, and while decoding otherwise. The memory held while decoding is about
    /// `4 · max_seconds · source_rate` bytes (115 MB for 10 min at 48 kHz). Qwen2-Audio and
    /// Whisper only look at the first 30 s; longer clips are accepted and truncated by the feature
    /// extractor, as transformers does.
    pub max_seconds: f64,
    /// Highest accepted source sample rate, in Hz (default 192 000).
    pub max_sample_rate: u32,
    /// Lowest accepted source sample rate, in Hz (default 4000; a rate of 0 is always refused).
    /// Resampling to 16 kHz multiplies the samples by `16 000 / rate`.
    pub min_sample_rate: u32,
    /// The samples (at 16 kHz, from the start) the caller uses; `None` (the default) keeps the
    /// whole clip. When set, the [`Waveform`] holds at most that many, the same bit for bit as
    /// the start of the whole clip resampled; only that window and the resampler's context are
    /// held in memory and resampled, and a clip whose header states its length (already checked
    /// against `max_seconds`) is not decoded further. Without a stated length the rest is still
    /// decoded, to enforce `max_seconds`, but not kept.
    pub keep_samples: Option<usize>,
}

impl Default for AudioLimits {
    fn default() -> Self {
        Self { max_seconds: 600.0, max_sample_rate: 192_000, min_sample_rate: 4000, keep_samples: None }
    }
}

/// Decoded audio.
#[derive(Debug, Clone, PartialEq)]
pub struct Waveform {
    /// Mono samples, nominally in [-1, 1].
    pub samples: Vec<f32>,
    /// Rate of `samples`: always [`TARGET_SAMPLE_RATE`] after [`decode_audio`].
    pub sample_rate: u32,
    /// Rate of the stream in the file.
    pub source_rate: u32,
    /// Channels in the file (averaged into `samples`).
    pub channels: usize,
}

impl Waveform {
    /// Duration in seconds.
    pub fn seconds(&self) -> f64 {
        self.samples.len() as f64 / f64::from(self.sample_rate)
    }
}

/// Decodes WAV (8/16/24/32-bit integer PCM, 32/64-bit float, A-law, µ-law, ADPCM), MP3, FLAC,
/// Ogg Vorbis and M4A/MP4 (AAC-LC) to 16 kHz mono. `format_hint` is a file extension (`"mp3"`,
/// `".wav"`) or a MIME type (`"audio/mpeg"`); the content decides, the hint only breaks ties.
pub fn decode_audio(bytes: &[u8], format_hint: Option<&str>, limits: &AudioLimits) -> Result<Waveform, AudioError> {
    guarded(|| decode(bytes, format_hint, limits))
}

/// Runs the container and codec readers so that a panic inside them (arithmetic
/// overflow on a hostile header, found by fuzzing) is the client's error, not the
/// process's: the readers are third-party code, and their input is the client's.
fn guarded<T>(f: impl FnOnce() -> Result<T, AudioError>) -> Result<T, AudioError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f))
        .unwrap_or_else(|_| Err(AudioError::Undecodable("the audio reader failed on this input".into())))
}

fn decode(bytes: &[u8], format_hint: Option<&str>, limits: &AudioLimits) -> Result<Waveform, AudioError> {
    let mut reader = open(bytes, format_hint)?;
    let (track_id, params, stated) = audio_track(reader.as_ref())?;
    // A stated rate is checked before anything is allocated; a container that states none gets
    // the decoder's rate, checked on the first buffer.
    if let Some(r) = params.sample_rate {
        check_rate(r, limits)?;
    }
    let mut rate = params.sample_rate.unwrap_or(0);
    if let Some(s) = stated.seconds.filter(|&s| s > limits.max_seconds) {
        return Err(AudioError::TooLong { seconds: Some(s), max_seconds: limits.max_seconds });
    }
    let mut decoder = symphonia::default::get_codecs()
        .make_audio_decoder(&params, &AudioDecoderOptions::default())
        .map_err(|e| match e {
            SymError::Unsupported(_) => AudioError::UnsupportedCodec(codec_name(params.codec)),
            e => undecodable(e),
        })?;

    let mp4 = reader.format_info().format == FORMAT_ID_ISOMP4;
    let window = |rate: u32| Window::new(bytes, mp4, rate, limits);
    let mut win = window(rate);
    // Trust the header's length for the allocation only as far as the file's size supports it.
    let most = |rate: u32| (limits.max_seconds * f64::from(rate)).floor() as u64;
    let mut mono: Vec<f32> = Vec::with_capacity(
        stated.frames.map_or(0, |n| n.min(most(rate)).min(win.hold as u64).min(bytes.len() as u64) as usize),
    );
    // Frames decoded (per channel), of which `mono` holds the first `win.hold` or so.
    let mut decoded = 0usize;
    let mut interleaved: Vec<f32> = Vec::new();
    let mut channels = 0;
    // 16-bit PCM (most WAV files) is converted here straight from the packet's bytes: the
    // same `i16 / 32768` and channel average as through the decoder, without its buffers.
    let s16 = s16_layout(&params);
    // The header's length is within the limit: past the kept window, nothing is left to learn.
    let stop_after_window = stated.seconds.is_some() && limits.keep_samples.is_some();
    let mut stopped_early = false;
    loop {
        if stop_after_window && decoded >= win.hold {
            stopped_early = true;
            break;
        }
        let packet = match reader.next_packet() {
            Ok(Some(p)) => p,
            // End of stream; `ResetRequired` starts a chained Ogg stream: only the first is read.
            Ok(None) | Err(SymError::ResetRequired) => break,
            Err(e) => return Err(undecodable(e)),
        };
        if packet.track_id != track_id {
            continue;
        }
        // Past the window, frames are counted, not kept.
        let room = win.hold.saturating_sub(mono.len());
        let frames = if let Some(c) = s16 {
            channels = c;
            let frames = packet.data.len() / (2 * c);
            s16_to_mono(&packet.data[..frames.min(room) * 2 * c], c, &mut mono);
            frames
        } else {
            let buf = decoder.decode(&packet).map_err(|e| match e {
                SymError::Unsupported(what) => {
                    AudioError::UnsupportedCodec(format!("{} ({what})", codec_name(params.codec)))
                }
                e => undecodable(e),
            })?;
            // The decoder's rate is the truth (the container may state none, or another one).
            if decoded == 0 {
                if buf.spec().rate() != rate {
                    rate = buf.spec().rate();
                    win = window(rate);
                }
                check_rate(rate, limits)?;
            } else if buf.spec().rate() != rate {
                return Err(AudioError::Undecodable(format!(
                    "the sample rate changes from {rate} Hz to {} Hz within the stream",
                    buf.spec().rate()
                )));
            }
            let c = buf.spec().channels().count();
            if c == 0 || (channels != 0 && c != channels) {
                return Err(AudioError::Undecodable("the channel count changes within the stream".into()));
            }
            channels = c;
            buf.copy_to_vec_interleaved(&mut interleaved);
            let frames = interleaved.len() / c;
            let kept = &interleaved[..frames.min(room) * c];
            if c == 1 {
                mono.extend_from_slice(kept);
            } else {
                let cf = c as f32;
                mono.extend(kept.chunks_exact(c).map(|f| f.iter().sum::<f32>() / cf));
            }
            frames
        };
        decoded += frames;
        check_length(decoded, rate, limits)?;
    }
    if let Some(n) = stated.frames.filter(|&n| (decoded as u64) < n && stated.exact && !stopped_early) {
        return Err(AudioError::Undecodable(format!(
            "the file is truncated: its header announces {n} samples per channel but it holds {decoded}"
        )));
    }
    if let Some((skip, keep)) = win.edit {
        let skip = skip.min(mono.len());
        mono.drain(..skip);
        mono.truncate(keep.unwrap_or(usize::MAX));
    }
    if mono.is_empty() {
        return Err(AudioError::Empty);
    }
    // Checked again where it matters: nothing longer than the limit reaches the resampler.
    check_length(mono.len(), rate, limits)?;
    // A fold rather than `all`: no early exit, so it vectorises. NaN fails the comparison.
    if !mono.iter().fold(true, |ok, x| ok & (x.abs() <= MAX_SAMPLE)) {
        return Err(AudioError::BadSamples);
    }
    let mut samples = resample(mono, rate, TARGET_SAMPLE_RATE)?;
    samples.truncate(limits.keep_samples.unwrap_or(usize::MAX));
    Ok(Waveform { samples, sample_rate: TARGET_SAMPLE_RATE, source_rate: rate, channels })
}

/// The source frames [`decode_audio`] holds at `rate`: with [`AudioLimits::keep_samples`], the
/// MP4 priming to skip, the kept window and two resampler blocks of context (each output block
/// of rubato's FFT resampler depends on its input block and the one before), so that the kept
/// samples are those of the whole clip resampled; otherwise all.
struct Window {
    hold: usize,
    /// The MP4 edit list at `rate` (see [`mp4_edit`]).
    edit: Option<(usize, Option<usize>)>,
}

impl Window {
    fn new(bytes: &[u8], mp4: bool, rate: u32, limits: &AudioLimits) -> Self {
        let edit = if mp4 && rate > 0 { mp4_edit(bytes, rate) } else { None };
        let hold = match limits.keep_samples {
            Some(keep) if rate > 0 => {
                let source = (keep as u128 * u128::from(rate)).div_ceil(u128::from(TARGET_SAMPLE_RATE));
                let context = 2 * resampler_block(rate, TARGET_SAMPLE_RATE) as u128;
                let skip = edit.map_or(0, |(skip, _)| skip as u128);
                usize::try_from(source + context + skip).unwrap_or(usize::MAX)
            }
            _ => usize::MAX,
        };
        Self { hold, edit }
    }
}

/// Refuses `frames` source frames at `rate` when they last longer than the limit.
fn check_length(frames: usize, rate: u32, limits: &AudioLimits) -> Result<(), AudioError> {
    if frames as f64 > (limits.max_seconds * f64::from(rate)).floor() {
        return Err(AudioError::TooLong { seconds: None, max_seconds: limits.max_seconds });
    }
    Ok(())
}

/// The duration (seconds) the container's header states, reading nothing else; `None` when the
/// container does not state one (e.g. an MP3 without a Xing/Info header, or a streamed WAV).
pub fn probe_duration(bytes: &[u8], format_hint: Option<&str>) -> Result<Option<f64>, AudioError> {
    guarded(|| {
        let reader = open(bytes, format_hint)?;
        Ok(audio_track(reader.as_ref())?.2.seconds)
    })
}

/// What the header says about the length.
struct Stated {
    frames: Option<u64>,
    seconds: Option<f64>,
    /// `frames` is exact for this codec (PCM and FLAC): decoding fewer means the file is truncated.
    exact: bool,
}

fn open<'a>(bytes: &'a [u8], format_hint: Option<&str>) -> Result<Box<dyn FormatReader + 'a>, AudioError> {
    if bytes.is_empty() {
        return Err(AudioError::Empty);
    }
    let mut hint = Hint::new();
    match format_hint.map(str::trim) {
        Some(h) if h.contains('/') => {
            hint.mime_type(h);
        }
        Some(h) if !h.is_empty() => {
            hint.with_extension(h.trim_start_matches('.'));
        }
        _ => {}
    }
    check_wav_channels(bytes)?;
    let mss = MediaSourceStream::new(Box::new(Cursor::new(unstream_wav(bytes))), Default::default());
    symphonia::default::get_probe().probe(&hint, mss, FormatOptions::default(), MetadataOptions::default()).map_err(
        |e| match (e, unsupported_container(bytes)) {
            (_, Some(name)) => AudioError::UnsupportedContainer(name.into()),
            (SymError::Unsupported(what), None) if what.starts_with("core") => {
                AudioError::Undecodable("not a recognised audio format".into())
            }
            // A reader recognised the container but refused it (e.g. an MP4 without its index).
            (SymError::Unsupported(what), None) => {
                AudioError::Undecodable(format!("unsupported or incomplete file ({what})"))
            }
            (e, None) => undecodable(e),
        },
    )
}

fn audio_track(reader: &dyn FormatReader) -> Result<(u32, AudioCodecParameters, Stated), AudioError> {
    let track = reader
        .default_track(TrackType::Audio)
        .or_else(|| reader.first_track(TrackType::Audio))
        .ok_or_else(|| AudioError::Undecodable("the file holds no audio track".into()))?;
    let Some(CodecParameters::Audio(params)) = &track.codec_params else {
        return Err(AudioError::Undecodable("the audio track has no codec parameters".into()));
    };
    Ok((track.id, params.clone(), stated_length(track, params)))
}

fn stated_length(track: &Track, params: &AudioCodecParameters) -> Stated {
    let rate = params.sample_rate.filter(|&r| r > 0);
    let seconds = match (track.num_frames, rate) {
        (Some(n), Some(r)) => Some(n as f64 / f64::from(r)),
        _ => track.time_base.zip(track.duration).map(|(tb, d)| tb.calc_duration_saturating(d).as_secs_f64()),
    };
    let c = params.codec;
    let exact = c == codec::CODEC_ID_FLAC || is_pcm(c);
    Stated { frames: track.num_frames, seconds, exact }
}

/// The channel count of a 16-bit little-endian PCM track whose samples need no shift and
/// whose rate is stated (what the fast path of [`decode_audio`] takes); `None` otherwise.
fn s16_layout(params: &AudioCodecParameters) -> Option<usize> {
    let full = |bits: Option<u32>| bits.is_none_or(|b| b == 16);
    let channels = params.channels.as_ref()?.count();
    (params.codec == codec::CODEC_ID_PCM_S16LE
        && full(params.bits_per_sample)
        && full(params.bits_per_coded_sample)
        && params.sample_rate.is_some_and(|r| r > 0)
        && channels > 0)
        .then_some(channels)
}

/// Appends the whole frames of interleaved 16-bit LE `data` to `mono`: `i16 / 32768`, the
/// channels averaged as the decoder path does (a partial frame at the end is dropped, as
/// symphonia's PCM decoder drops it).
fn s16_to_mono(data: &[u8], channels: usize, mono: &mut Vec<f32>) {
    // Fixed-size pairs (not `chunks_exact(2)`), so that the mono loop vectorises.
    let sample = |b: [u8; 2]| f32::from(i16::from_le_bytes(b)) / 32_768.0;
    let (pairs, _) = data.as_chunks::<2>();
    if channels == 1 {
        mono.extend(pairs.iter().map(|&b| sample(b)));
    } else {
        let cf = channels as f32;
        mono.extend(pairs.chunks_exact(channels).map(|f| f.iter().map(|&b| sample(b)).sum::<f32>() / cf));
    }
}

fn is_pcm(c: AudioCodecId) -> bool {
    use codec::*;
    [
        CODEC_ID_PCM_S8,
        CODEC_ID_PCM_U8,
        CODEC_ID_PCM_S16LE,
        CODEC_ID_PCM_S16BE,
        CODEC_ID_PCM_U16LE,
        CODEC_ID_PCM_U16BE,
        CODEC_ID_PCM_S24LE,
        CODEC_ID_PCM_S24BE,
        CODEC_ID_PCM_U24LE,
        CODEC_ID_PCM_U24BE,
        CODEC_ID_PCM_S32LE,
        CODEC_ID_PCM_S32BE,
        CODEC_ID_PCM_U32LE,
        CODEC_ID_PCM_U32BE,
        CODEC_ID_PCM_F32LE,
        CODEC_ID_PCM_F32BE,
        CODEC_ID_PCM_F64LE,
        CODEC_ID_PCM_F64BE,
        CODEC_ID_PCM_ALAW,
        CODEC_ID_PCM_MULAW,
    ]
    .contains(&c)
}

fn check_rate(rate: u32, limits: &AudioLimits) -> Result<(), AudioError> {
    let min_rate = limits.min_sample_rate.max(1);
    match rate {
        r if r < min_rate => Err(AudioError::SampleRateTooLow { rate: r, min_rate }),
        r if r > limits.max_sample_rate => {
            Err(AudioError::UnsupportedSampleRate { rate: r, max_rate: limits.max_sample_rate })
        }
        _ => Ok(()),
    }
}

fn undecodable(e: SymError) -> AudioError {
    match e {
        SymError::IoError(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            AudioError::Undecodable("the file is truncated".into())
        }
        SymError::IoError(e) => AudioError::Undecodable(e.to_string()),
        SymError::DecodeError(what) => AudioError::Undecodable(format!("malformed data ({what})")),
        SymError::Unsupported(what) => AudioError::Undecodable(format!("unsupported feature ({what})")),
        SymError::LimitError(what) => AudioError::Undecodable(format!("a decoder limit was reached ({what})")),
        e => AudioError::Undecodable(e.to_string()),
    }
}

/// A RIFF WAVE file's chunks: (offset of the chunk's header, its id, its stated length);
/// nothing for other files.
fn wav_chunks(bytes: &[u8]) -> impl Iterator<Item = (usize, &[u8], usize)> {
    let wave = bytes.get(..4) == Some(b"RIFF") && bytes.get(8..12) == Some(b"WAVE");
    let mut at = if wave { 12 } else { usize::MAX };
    std::iter::from_fn(move || {
        let header = bytes.get(at..at.checked_add(8)?)?;
        let len = u32::from_le_bytes([header[4], header[5], header[6], header[7]]) as usize;
        let chunk = (at, &header[..4], len);
        at = at.saturating_add(8).saturating_add(len).saturating_add(len & 1);
        Some(chunk)
    })
}

/// A WAV written as a stream states its data length as 0xFFFFFFFF; symphonia then drops the last
/// partial packet at the end of the file. Such a file gets the length that is really there.
fn unstream_wav(bytes: &[u8]) -> Cow<'_, [u8]> {
    match wav_chunks(bytes).find(|(_, id, _)| *id == b"data") {
        Some((at, _, len)) if len == u32::MAX as usize => {
            let real = u32::try_from(bytes.len() - at - 8).unwrap_or(u32::MAX - 1);
            let mut patched = bytes.to_vec();
            patched[at + 4..at + 8].copy_from_slice(&real.to_le_bytes());
            Cow::Owned(patched)
        }
        _ => Cow::Borrowed(bytes),
    }
}

/// Most channels a WAV file may declare: no recording has more, and the WAV reader's
/// arithmetic on the count (channels × bytes per sample in 16 bits) must not overflow.
const MAX_WAV_CHANNELS: u16 = 64;

/// Refuses a WAV `fmt ` chunk that declares no channels or absurdly many.
fn check_wav_channels(bytes: &[u8]) -> Result<(), AudioError> {
    let Some((at, _, _)) = wav_chunks(bytes).find(|(_, id, _)| *id == b"fmt ") else { return Ok(()) };
    let Some(c) = bytes.get(at + 10..at + 12) else { return Ok(()) };
    let channels = u16::from_le_bytes([c[0], c[1]]);
    if channels == 0 || channels > MAX_WAV_CHANNELS {
        return Err(AudioError::Undecodable(format!(
            "the WAV header declares {channels} channels (at most {MAX_WAV_CHANNELS} are read)"
        )));
    }
    Ok(())
}

/// Names a few containers that the prober does not read, from their magic bytes.
fn unsupported_container(b: &[u8]) -> Option<&'static str> {
    let at = |off: usize, magic: &[u8]| b.get(off..off + magic.len()) == Some(magic);
    Some(match () {
        _ if at(0, b"\x1a\x45\xdf\xa3") => "Matroska/WebM",
        _ if at(0, b"FORM") && (at(8, b"AIFF") || at(8, b"AIFC")) => "AIFF",
        _ if at(0, b"caff") => "CAF",
        _ if at(0, b"\x30\x26\xb2\x75\x8e\x66\xcf\x11") => "ASF/WMA",
        _ if at(0, b"#!AMR") => "AMR",
        _ if at(0, b"wvpk") => "WavPack",
        _ if at(0, b"MAC ") => "Monkey's Audio",
        _ if at(0, b"MThd") => "MIDI",
        _ if at(0, b"RIFF") && !at(8, b"WAVE") => "RIFF (not WAVE)",
        _ if at(0, b"RF64") => "RF64",
        _ => return None,
    })
}

fn codec_name(c: AudioCodecId) -> String {
    use codec::*;
    let name = match c {
        CODEC_ID_OPUS => "Opus",
        CODEC_ID_ALAC => "ALAC",
        CODEC_ID_SPEEX => "Speex",
        CODEC_ID_WMA => "WMA",
        CODEC_ID_AC3 => "AC-3",
        CODEC_ID_EAC3 => "E-AC-3",
        CODEC_ID_AC4 => "AC-4",
        CODEC_ID_DCA => "DTS",
        CODEC_ID_MP1 => "MPEG-1 Layer I",
        CODEC_ID_MP2 => "MPEG Layer II",
        CODEC_ID_ADPCM_G722 => "G.722",
        CODEC_ID_ADPCM_G726 | CODEC_ID_ADPCM_G726LE => "G.726",
        CODEC_ID_WAVPACK => "WavPack",
        CODEC_ID_MONKEYS_AUDIO => "Monkey's Audio",
        CODEC_ID_TTA => "TTA",
        CODEC_ID_TRUEHD => "TrueHD",
        CODEC_ID_MUSEPACK => "Musepack",
        CODEC_ID_ATRAC1 | CODEC_ID_ATRAC3 | CODEC_ID_ATRAC3PLUS | CODEC_ID_ATRAC9 => "ATRAC",
        CODEC_ID_AAC => "AAC",
        CODEC_ID_NULL_AUDIO => "unknown codec",
        c => return format!("codec id {c}"),
    };
    name.to_owned()
}

/// The edit list of an MP4/M4A file's only sound track, which symphonia does not apply: the
/// encoder's priming frames to skip and the frames to keep (AAC encoders put ~1024-2112 priming
/// frames first), at `rate`. Only a single edit is understood; anything else is left alone.
fn mp4_edit(bytes: &[u8], rate: u32) -> Option<(usize, Option<usize>)> {
    let moov = mp4_box(bytes, b"moov")?;
    let movie_scale = mp4_timescale(mp4_box(moov, b"mvhd")?)?;
    let mut sound = mp4_boxes(moov).filter(|(kind, _)| kind == b"trak").map(|(_, t)| t).filter(|trak| {
        mp4_box(trak, b"mdia").and_then(|m| mp4_box(m, b"hdlr")).and_then(|h| h.get(8..12)) == Some(b"soun")
    });
    let (trak, None) = (sound.next()?, sound.next()) else { return None };
    let media_scale = mp4_timescale(mp4_box(mp4_box(trak, b"mdia")?, b"mdhd")?)?;
    let elst = mp4_box(mp4_box(trak, b"edts")?, b"elst")?;
    let (v1, count) = (elst.first()? == &1, u32::from_be_bytes(elst.get(4..8)?.try_into().ok()?));
    if count != 1 {
        return None;
    }
    let (duration, media_time) = if v1 {
        (be(elst.get(8..16)?), be(elst.get(16..24)?) as i64)
    } else {
        (be(elst.get(8..12)?), i64::from(be(elst.get(12..16)?) as u32 as i32))
    };
    let scale = |v: u64, from: u64| usize::try_from(u128::from(v) * u128::from(rate) / u128::from(from)).ok();
    let skip = scale(u64::try_from(media_time).ok()?, media_scale)?;
    // A zero duration means "to the end of the media".
    Some((skip, if duration == 0 { None } else { scale(duration, movie_scale) }))
}

fn be(b: &[u8]) -> u64 {
    b.iter().fold(0, |acc, &x| acc << 8 | u64::from(x))
}

/// The `timescale` of an `mvhd` or `mdhd` box body (non-zero).
fn mp4_timescale(body: &[u8]) -> Option<u64> {
    let at = if *body.first()? == 1 { 20 } else { 12 };
    Some(be(body.get(at..at + 4)?)).filter(|&t| t > 0)
}

/// The child boxes of `data`: (type, body).
fn mp4_boxes(mut data: &[u8]) -> impl Iterator<Item = ([u8; 4], &[u8])> {
    std::iter::from_fn(move || {
        let size = be(data.get(..4)?);
        let kind: [u8; 4] = data.get(4..8)?.try_into().ok()?;
        let (header, size) = match size {
            0 => (8, data.len() as u64),
            1 => (16, be(data.get(8..16)?)),
            n => (8, n),
        };
        let size = usize::try_from(size).ok().filter(|&n| n >= header && n <= data.len())?;
        let body = &data[header..size];
        data = &data[size..];
        Some((kind, body))
    })
}

fn mp4_box<'a>(data: &'a [u8], kind: &[u8; 4]) -> Option<&'a [u8]> {
    mp4_boxes(data).find(|(k, _)| k == kind).map(|(_, body)| body)
}

/// Band-limited resampling of a whole clip to `to` Hz, `ceil(n · to / from)` samples out.
fn resample(samples: Vec<f32>, from: u32, to: u32) -> Result<Vec<f32>, AudioError> {
    if from == to {
        return Ok(samples);
    }
    let n = samples.len();
    let failed = |e: &dyn std::fmt::Display| AudioError::Undecodable(format!("resampling failed: {e}"));
    // One FFT block of about 2048 input frames: a sharp anti-aliasing filter (cut-off within ~2%
    // of the lower Nyquist frequency) at a modest cost. The block sizes must be even: the filter is
    // centred on sample `block / 2` and rubato trims `block_out / 2` output frames of delay, so an
    // odd block would leave the output shifted by half an input sample.
    let mut resampler = Fft::<f32>::new_custom(
        from as usize,
        to as usize,
        resampler_block(from, to),
        1,
        1,
        WindowFunction::BlackmanHarris2,
        FixedSync::Input,
    )
    .map_err(|e| failed(&e))?;
    let input = InterleavedSlice::new(&samples, 1, n).map_err(|e| failed(&e))?;
    let out = resampler.process_all(&input, n, None).map_err(|e| failed(&e))?;
    Ok(out.take_data())
}

/// Input frames per block of [`resample`]'s FFT resampler.
fn resampler_block(from: u32, to: u32) -> usize {
    let min_in = (from / gcd(from, to)) as usize;
    2048usize.div_ceil(min_in).next_multiple_of(2) * min_in
}

fn gcd(mut a: u32, mut b: u32) -> u32 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

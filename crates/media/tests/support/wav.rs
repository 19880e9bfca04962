//! WAV files made in tests (shared by the media crate's tests and the end-to-end ones).

/// A 16-bit mono WAV at `rate`; `data_len` overrides the data chunk's stated length.
pub fn wav16(samples: &[i16], rate: u32, data_len: Option<u32>) -> Vec<u8> {
    let data: Vec<u8> = samples.iter().flat_map(|s| s.to_le_bytes()).collect();
    let len = data_len.unwrap_or(data.len() as u32);
    let mut b = b"RIFF".to_vec();
    b.extend(len.saturating_add(36).to_le_bytes());
    b.extend(b"WAVEfmt ");
    for v in [16u32, 1 | 1 << 16, rate, rate.wrapping_mul(2), 2 | 16 << 16] {
        b.extend(v.to_le_bytes());
    }
    b.extend(b"data");
    b.extend(len.to_le_bytes());
    b.extend(data);
    b
}

//! A JPEG decoder that reproduces libjpeg-turbo as Pillow drives it, value for value:
//! Huffman-coded baseline, extended and progressive JPEG; the accurate integer IDCT
//! (`jidctint.c`); fancy (triangle) chroma upsampling for 2:1 factors, replication for
//! other integral ones, with libjpeg's edge handling; YCbCr → RGB through libjpeg's
//! fixed-point tables; libjpeg's choice of colour space from the JFIF / Adobe markers and
//! component ids; then Pillow's own conversions (grey replicated, Adobe CMYK inverted).
//!
//! [`decode`] answers `None` for what it does not reproduce (arithmetic coding, lossless
//! and hierarchical JPEG, progressive files whose coefficients are never fully refined,
//! where libjpeg smooths blocks, non-integral sampling, broken entropy data that libjpeg
//! would have to resynchronise): the caller then falls back on another decoder.

use crate::simd::dispatch;

/// `jpeg_natural_order`, with the 16 extra entries libjpeg uses to absorb bad data.
const NATURAL: [usize; 80] = {
    const Z: [usize; 64] = [
        0, 1, 8, 16, 9, 2, 3, 10, 17, 24, 32, 25, 18, 11, 4, 5, 12, 19, 26, 33, 40, 48, 41, 34, 27, 20, 13, 6, 7, 14,
        21, 28, 35, 42, 49, 56, 57, 50, 43, 36, 29, 22, 15, 23, 30, 37, 44, 51, 58, 59, 52, 45, 38, 31, 39, 46, 53, 60,
        61, 54, 47, 55, 62, 63,
    ];
    let mut out = [63; 80];
    let mut i = 0;
    while i < 64 {
        out[i] = Z[i];
        i += 1;
    }
    out
};

/// libjpeg's YCbCr → RGB (`jdcolor.c`, 16-bit fixed point), before clamping.
#[inline(always)]
pub(crate) fn ycc_to_rgb(y: u8, cb: u8, cr: u8) -> [i32; 3] {
    const fn fix(x: f64) -> i32 {
        (x * 65536.0 + 0.5) as i32
    }
    let (y, cb, cr) = (i32::from(y), i32::from(cb) - 128, i32::from(cr) - 128);
    let r = (fix(1.402) * cr + (1 << 15)) >> 16;
    let b = (fix(1.772) * cb + (1 << 15)) >> 16;
    let g = (-FIX_0_34414 * cb + (1 << 15) - FIX_0_71414 * cr) >> 16;
    [y + r, y + g, y + b]
}

/// Pillow's CMYK → RGB on libjpeg's CMYK samples, which Pillow reads as Adobe-inverted
/// (`CMYK;I`): with ink `c = 255 - stored`, R = (255 - k) - round(c·(255 - k)/255).
pub(crate) fn pillow_cmyk(stored: [u8; 4]) -> [u8; 3] {
    let nk = i32::from(stored[3]);
    let muldiv255 = |a: i32, b: i32| {
        let t = a * b + 128;
        ((t >> 8) + t) >> 8
    };
    [0, 1, 2].map(|i| (nk - muldiv255(255 - i32::from(stored[i]), nk)).clamp(0, 255) as u8)
}

/// libjpeg's YCCK → CMYK: the colour part is inverted YCbCr → RGB, K passes through.
pub(crate) fn ycck_to_cmyk(p: [u8; 4]) -> [u8; 4] {
    let [c, m, y] = ycc_to_rgb(p[0], p[1], p[2]).map(|v| (255 - v).clamp(0, 255) as u8);
    [c, m, y, p[3]]
}

/// A Huffman table as `jpeg_make_d_derived_tbl` builds it, plus a 9-bit lookahead.
#[derive(Clone)]
struct Huffman {
    maxcode: [i32; 18],
    valoffset: [i32; 17],
    values: Vec<u8>,
    /// `(length, symbol)` for codes of at most 9 bits, indexed by the next 9 bits.
    fast: Vec<(u8, u8)>,
    /// For an AC table: `(coefficient, run, length)` where a code and its extra bits fit
    /// in the next 9 bits together (length 0: decode the slow way), so that most
    /// coefficients of a baseline block take one lookup.
    fast_ac: Vec<(i16, u8, u8)>,
}

const FAST_BITS: u32 = 9;
/// Most scans decoded in one image (libjpeg's progressive scripts use about 10).
const MAX_SCANS: usize = 100;

impl Huffman {
    fn new(counts: &[u8; 16], values: Vec<u8>) -> Option<Self> {
        let mut sizes = Vec::new();
        for (l, &n) in counts.iter().enumerate() {
            sizes.extend(std::iter::repeat_n(l as u8 + 1, usize::from(n)));
        }
        if sizes.len() > 256 || sizes.len() > values.len() {
            return None;
        }
        let mut codes = Vec::with_capacity(sizes.len());
        let (mut code, mut si, mut p) = (0i32, sizes.first().copied().unwrap_or(1), 0);
        while p < sizes.len() {
            while p < sizes.len() && sizes[p] == si {
                codes.push(code);
                code += 1;
                p += 1;
            }
            if code >= 1 << si {
                return None; // libjpeg: bad Huffman table
            }
            code <<= 1;
            si += 1;
        }
        let (mut maxcode, mut valoffset) = ([-1i32; 18], [0i32; 17]);
        let mut p = 0;
        for l in 1..=16 {
            let n = usize::from(counts[l - 1]);
            if n > 0 {
                valoffset[l] = p as i32 - codes[p];
                p += n;
                maxcode[l] = codes[p - 1];
            }
        }
        maxcode[17] = 0xFFFFF;
        let mut fast = vec![(0u8, 0u8); 1 << FAST_BITS];
        let mut fast_ac = vec![(0i16, 0u8, 0u8); 1 << FAST_BITS];
        for (i, (&len, &code)) in sizes.iter().zip(&codes).enumerate() {
            let len = u32::from(len);
            if len <= FAST_BITS {
                let shift = FAST_BITS - len;
                let base = (code as usize) << shift;
                for entry in &mut fast[base..base + (1 << shift)] {
                    *entry = (len as u8, values[i]);
                }
                let (run, size) = (values[i] >> 4, u32::from(values[i] & 15));
                if size != 0 && len + size <= FAST_BITS {
                    for (e, entry) in fast_ac[base..base + (1 << shift)].iter_mut().enumerate() {
                        let extra = (e >> (shift - size)) as i32 & ((1 << size) - 1);
                        *entry = (extend(extra, size as u8) as i16, run, (len + size) as u8);
                    }
                }
            }
        }
        Some(Self { maxcode, valoffset, values, fast, fast_ac })
    }
}

/// The entropy-coded data reader: `0xFF 0x00` is a data byte, a marker ends the data and
/// zeros are supplied past it (as libjpeg does).
struct Bits<'a> {
    data: &'a [u8],
    pos: usize,
    acc: u64,
    n: u32,
    /// A marker (or the end of the data) was reached at `pos`.
    at_marker: bool,
}

impl<'a> Bits<'a> {
    fn new(data: &'a [u8], pos: usize) -> Self {
        Self { data, pos, acc: 0, n: 0, at_marker: false }
    }

    #[inline(always)]
    fn fill(&mut self) {
        // The common case: the next eight bytes hold no 0xFF, so the bytes the loop below
        // would take one at a time go in at once.
        if !self.at_marker
            && self.n <= 56
            && let Some(next) = self.data.get(self.pos..self.pos + 8)
        {
            let chunk = u64::from_be_bytes(next.try_into().expect("eight bytes"));
            let inverted = !chunk;
            let has_ff = inverted.wrapping_sub(0x0101_0101_0101_0101) & !inverted & 0x8080_8080_8080_8080 != 0;
            if !has_ff {
                let take = (56 - self.n) / 8 + 1;
                let bits = 8 * take;
                let top = if bits == 64 { chunk } else { chunk >> (64 - bits) };
                self.acc |= top << (64 - self.n - bits);
                self.n += bits;
                self.pos += take as usize;
                return;
            }
        }
        self.fill_bytewise();
    }

    /// Byte by byte, through stuffed zeros and up to a marker.
    #[cold]
    #[inline(never)]
    fn fill_bytewise(&mut self) {
        while self.n <= 56 {
            let mut byte = 0;
            if !self.at_marker {
                match self.data.get(self.pos) {
                    None => self.at_marker = true,
                    Some(&0xff) => {
                        let mut next = self.pos + 1;
                        while self.data.get(next) == Some(&0xff) {
                            next += 1;
                        }
                        if self.data.get(next) == Some(&0) {
                            byte = 0xff;
                            self.pos = next + 1;
                        } else {
                            self.at_marker = true;
                        }
                    }
                    Some(&b) => {
                        byte = b;
                        self.pos += 1;
                    }
                }
            }
            self.acc |= u64::from(byte) << (56 - self.n);
            self.n += 8;
        }
    }

    fn bits(&mut self, count: u32) -> i32 {
        if count == 0 {
            return 0;
        }
        if self.n < count {
            self.fill();
        }
        let v = (self.acc >> (64 - count)) as i32;
        self.acc <<= count;
        self.n -= count;
        v
    }

    fn bit(&mut self) -> bool {
        self.bits(1) != 0
    }

    /// The next symbol; `None` for a code libjpeg calls bad.
    #[inline(always)]
    fn decode(&mut self, h: &Huffman) -> Option<u8> {
        if self.n < 16 {
            self.fill();
        }
        let (len, sym) = h.fast[(self.acc >> (64 - FAST_BITS)) as usize];
        if len > 0 {
            self.acc <<= len;
            self.n -= u32::from(len);
            return Some(sym);
        }
        self.decode_long(h)
    }

    /// A code longer than the lookahead, bit by bit as libjpeg's `jpeg_huff_decode`.
    #[cold]
    #[inline(never)]
    fn decode_long(&mut self, h: &Huffman) -> Option<u8> {
        let mut code = self.bits(1);
        let mut l = 1;
        while code > h.maxcode[l] {
            code = (code << 1) | self.bits(1);
            l += 1;
            if l > 16 {
                return None;
            }
        }
        h.values.get((code + h.valoffset[l]) as usize).copied()
    }
}

/// `HUFF_EXTEND`.
fn extend(v: i32, s: u8) -> i32 {
    if s == 0 {
        0
    } else if v < 1 << (s - 1) {
        v - (1 << s) + 1
    } else {
        v
    }
}

struct Component {
    id: u8,
    h: usize,
    v: usize,
    tq: usize,
    /// Blocks allocated per row and column (whole MCUs).
    bw: usize,
    bh: usize,
    /// Blocks holding image data.
    width_in_blocks: usize,
    height_in_blocks: usize,
    /// Samples holding image data.
    dw: usize,
    dh: usize,
    coefs: Vec<i16>,
    quant: Option<[u16; 64]>,
    /// Successive-approximation state per coefficient (-1: never sent).
    coef_bits: [i32; 64],
}

struct Frame {
    width: usize,
    height: usize,
    progressive: bool,
    comps: Vec<Component>,
    max_h: usize,
    max_v: usize,
    mcus_x: usize,
    mcus_y: usize,
}

fn be16(b: &[u8], at: usize) -> Option<usize> {
    Some(usize::from(u16::from_be_bytes([*b.get(at)?, *b.get(at + 1)?])))
}

/// Finds the next marker at or after `pos` (libjpeg's `next_marker`): returns its code and
/// the position after it.
fn next_marker(data: &[u8], mut pos: usize) -> Option<(u8, usize)> {
    loop {
        pos += data.get(pos..)?.iter().position(|&c| c == 0xff)?;
        while data.get(pos) == Some(&0xff) {
            pos += 1;
        }
        let c = *data.get(pos)?;
        pos += 1;
        if c != 0 {
            return Some((c, pos));
        }
    }
}

/// Decodes a JPEG to RGB8 (after Pillow's conversions) as `(width, height, pixels)`, or
/// `None` where this decoder does not reproduce libjpeg (see the module doc).
pub(crate) fn decode(data: &[u8], max_pixels: u64) -> Option<(u32, u32, Vec<u8>)> {
    if !data.starts_with(&[0xff, 0xd8]) {
        return None;
    }
    let mut qt: [Option<[u16; 64]>; 4] = [None; 4];
    let mut dc_tables: [Option<Huffman>; 4] = Default::default();
    let mut ac_tables: [Option<Huffman>; 4] = Default::default();
    let (mut restart_interval, mut jfif, mut adobe) = (0usize, false, None);
    let mut frame: Option<Frame> = None;
    let (mut pos, mut scans) = (2, 0);
    loop {
        let (marker, after) = next_marker(data, pos)?;
        pos = after;
        match marker {
            0xd8 | 0x01 | 0xd0..=0xd7 => continue,
            0xd9 => break,
            _ => {}
        }
        let len = be16(data, pos)?;
        let seg = data.get(pos + 2..pos + len.max(2))?;
        if len < 2 {
            return None;
        }
        pos += len;
        match marker {
            0xc0..=0xc2 => {
                if frame.is_some() {
                    return None;
                }
                frame = Some(parse_frame(seg, marker == 0xc2, max_pixels)?);
            }
            0xc3 | 0xc5..=0xc7 | 0xc9..=0xcb | 0xcd..=0xcf => return None,
            0xc4 => {
                let mut s = seg;
                while !s.is_empty() {
                    let (class, id) = (s[0] >> 4, usize::from(s[0] & 15));
                    let counts: [u8; 16] = s.get(1..17)?.try_into().ok()?;
                    let n: usize = counts.iter().map(|&c| usize::from(c)).sum();
                    let values = s.get(17..17 + n)?.to_vec();
                    if id > 3 || class > 1 || (class == 0 && values.iter().any(|&v| v > 15)) {
                        return None;
                    }
                    let table = Huffman::new(&counts, values)?;
                    if class == 0 {
                        dc_tables[id] = Some(table)
                    } else {
                        ac_tables[id] = Some(table)
                    }
                    s = &s[17 + n..];
                }
            }
            0xdb => {
                let mut s = seg;
                while !s.is_empty() {
                    let (precision, id) = (s[0] >> 4, usize::from(s[0] & 15));
                    if id > 3 || precision > 1 {
                        return None;
                    }
                    let mut table = [0u16; 64];
                    for (k, &zz) in NATURAL[..64].iter().enumerate() {
                        table[zz] = if precision == 0 { u16::from(*s.get(1 + k)?) } else { be16(s, 1 + 2 * k)? as u16 };
                    }
                    qt[id] = Some(table);
                    s = s.get(1 + 64 * (1 + usize::from(precision))..)?;
                }
            }
            0xdd => restart_interval = be16(seg, 0)?,
            0xe0 if seg.len() >= 14 && seg.starts_with(b"JFIF\0") => jfif = true,
            0xee if seg.len() >= 12 && seg.starts_with(b"Adobe") => adobe = Some(seg[11]),
            0xda => {
                // Bounds the work a hostile progressive file can ask for (zune-jpeg, the
                // fallback, refuses past its own limit).
                scans += 1;
                if scans > MAX_SCANS {
                    return None;
                }
                let f = frame.as_mut()?;
                pos = decode_scan(f, seg, data, pos, &qt, &dc_tables, &ac_tables, restart_interval)?;
            }
            _ => {}
        }
    }
    let f = frame?;
    if f.progressive && f.comps.iter().any(|c| c.coef_bits[1..10].iter().any(|&b| b != 0)) {
        return None; // libjpeg would smooth the blocks of this incompletely refined image
    }
    if f.comps.iter().any(|c| !f.max_h.is_multiple_of(c.h) || !f.max_v.is_multiple_of(c.v)) {
        return None; // libjpeg: fractional sampling not implemented
    }
    let planes: Vec<Vec<u8>> = f.comps.iter().map(idct_plane).collect::<Option<_>>()?;
    let ids: Vec<u8> = f.comps.iter().map(|c| c.id).collect();
    let is_rgb = !jfif && (adobe == Some(0) || (adobe.is_none() && ids == *b"RGB"));
    let ycck = matches!(adobe, Some(t) if t != 0);
    // A row at a time: each component's row upsampled (or borrowed, at full size) into a
    // row buffer, then converted. No full-size upsampled planes: they cost as much to
    // clear, write and read back as the conversion itself.
    let w = f.width;
    let mut rgb = vec![0u8; w * f.height * 3];
    let mut scratch: Vec<UpsampleRow> = f.comps.iter().map(|c| UpsampleRow::new(c.dw, w)).collect();
    for (oy, out) in rgb.chunks_exact_mut(w * 3).enumerate() {
        let mut rows: [&[u8]; 4] = [&[]; 4];
        for ((row, (c, plane)), s) in rows.iter_mut().zip(f.comps.iter().zip(&planes)).zip(&mut scratch) {
            *row = upsample_row(&f, c, plane, oy, s);
        }
        row_to_rgb(&rows[..f.comps.len()], is_rgb, ycck, out);
    }
    Some((f.width as u32, f.height as u32, rgb))
}

fn parse_frame(seg: &[u8], progressive: bool, max_pixels: u64) -> Option<Frame> {
    let (precision, height, width, count) = (*seg.first()?, be16(seg, 1)?, be16(seg, 3)?, usize::from(*seg.get(5)?));
    if precision != 8 || width == 0 || height == 0 || !matches!(count, 1 | 3 | 4) {
        return None;
    }
    if (width * height) as u64 > max_pixels {
        return None;
    }
    let mut comps = Vec::with_capacity(count);
    for i in 0..count {
        let c = seg.get(6 + 3 * i..9 + 3 * i)?;
        let (h, v, tq) = (usize::from(c[1] >> 4), usize::from(c[1] & 15), usize::from(c[2]));
        if !(1..=4).contains(&h) || !(1..=4).contains(&v) || tq > 3 {
            return None;
        }
        comps.push(Component {
            id: c[0],
            h,
            v,
            tq,
            bw: 0,
            bh: 0,
            width_in_blocks: 0,
            height_in_blocks: 0,
            dw: 0,
            dh: 0,
            coefs: Vec::new(),
            quant: None,
            coef_bits: [-1; 64],
        });
    }
    let max_h = comps.iter().map(|c| c.h).max()?;
    let max_v = comps.iter().map(|c| c.v).max()?;
    let (mcus_x, mcus_y) = (width.div_ceil(8 * max_h), height.div_ceil(8 * max_v));
    for c in &mut comps {
        c.width_in_blocks = (width * c.h).div_ceil(8 * max_h);
        c.height_in_blocks = (height * c.v).div_ceil(8 * max_v);
        c.dw = (width * c.h).div_ceil(max_h);
        c.dh = (height * c.v).div_ceil(max_v);
        c.bw = mcus_x * c.h;
        c.bh = mcus_y * c.v;
        c.coefs = vec![0; c.bw * c.bh * 64];
    }
    Some(Frame { width, height, progressive, comps, max_h, max_v, mcus_x, mcus_y })
}

/// Decodes one scan's entropy-coded data into the frame's coefficients; returns the
/// position where marker parsing resumes.
#[allow(clippy::too_many_arguments)]
fn decode_scan(
    f: &mut Frame,
    seg: &[u8],
    data: &[u8],
    pos: usize,
    qt: &[Option<[u16; 64]>; 4],
    dc_tables: &[Option<Huffman>; 4],
    ac_tables: &[Option<Huffman>; 4],
    restart_interval: usize,
) -> Option<usize> {
    let ns = usize::from(*seg.first()?);
    if ns == 0 || ns > 4 {
        return None;
    }
    let mut scan = Vec::with_capacity(ns);
    for i in 0..ns {
        let (id, tables) = (*seg.get(1 + 2 * i)?, *seg.get(2 + 2 * i)?);
        let ci = f.comps.iter().position(|c| c.id == id)?;
        scan.push((ci, usize::from(tables >> 4), usize::from(tables & 15)));
    }
    let (ss, se, ah, al) = {
        let s = seg.get(1 + 2 * ns..4 + 2 * ns)?;
        (usize::from(s[0]), usize::from(s[1]), u32::from(s[2] >> 4), u32::from(s[2] & 15))
    };
    if f.progressive && (ss > se || se > 63 || (ss == 0 && se != 0) || (ss != 0 && ns != 1) || al > 13 || ah > 13) {
        return None;
    }
    let (ss, se, ah, al) = if f.progressive { (ss, se, ah, al) } else { (0, 63, 0, 0) };
    // Quantisation tables are latched at a component's first scan.
    for &(ci, td, ta) in &scan {
        let c = &mut f.comps[ci];
        if c.quant.is_none() {
            c.quant = Some(qt[c.tq]?);
        }
        let need_dc = ss == 0 && ah == 0;
        let need_ac = se > 0;
        if (need_dc && dc_tables.get(td)?.is_none()) || (need_ac && ac_tables.get(ta)?.is_none()) {
            return None;
        }
        for k in ss..=se {
            c.coef_bits[k] = al as i32;
        }
    }
    let mut bits = Bits::new(data, pos);
    let mut last_dc = [0i32; 4];
    let mut eobrun = 0u32;
    let (mut restarts_to_go, mut next_restart) = (restart_interval, 0u8);
    // The blocks of each MCU: (component index in scan, block row, block column).
    let single = ns == 1;
    let (mcus_x, mcus_y) = if single {
        let c = &f.comps[scan[0].0];
        (c.width_in_blocks, c.height_in_blocks)
    } else {
        (f.mcus_x, f.mcus_y)
    };
    for my in 0..mcus_y {
        for mx in 0..mcus_x {
            if restart_interval > 0 {
                if restarts_to_go == 0 {
                    // Expect RSTn; anything else needs libjpeg's resynchronisation.
                    let (m, after) = next_marker(data, bits.pos)?;
                    if m != 0xd0 + next_restart {
                        return None;
                    }
                    next_restart = (next_restart + 1) & 7;
                    bits = Bits::new(data, after);
                    last_dc = [0; 4];
                    eobrun = 0;
                    restarts_to_go = restart_interval;
                }
                restarts_to_go -= 1;
            }
            for (si, &(ci, td, ta)) in scan.iter().enumerate() {
                let c = &mut f.comps[ci];
                let (bh, bv) = if single { (1, 1) } else { (c.h, c.v) };
                for v in 0..bv {
                    for h in 0..bh {
                        let (row, col) = if single { (my, mx) } else { (my * c.v + v, mx * c.h + h) };
                        let at = (row * c.bw + col) * 64;
                        let block: &mut [i16; 64] = (&mut c.coefs[at..at + 64]).try_into().expect("64 coefficients");
                        let ok = if !f.progressive {
                            decode_block(
                                &mut bits,
                                dc_tables[td].as_ref()?,
                                ac_tables[ta].as_ref()?,
                                &mut last_dc[si],
                                block,
                            )
                        } else if ss == 0 {
                            if ah == 0 {
                                dc_first(&mut bits, dc_tables[td].as_ref()?, &mut last_dc[si], block, al)
                            } else {
                                block[0] |= (i32::from(bits.bit()) << al) as i16;
                                Some(())
                            }
                        } else if ah == 0 {
                            ac_first(&mut bits, ac_tables[ta].as_ref()?, block, ss, se, al, &mut eobrun)
                        } else {
                            ac_refine(&mut bits, ac_tables[ta].as_ref()?, block, ss, se, al, &mut eobrun)
                        };
                        ok?;
                    }
                }
            }
        }
    }
    Some(bits.pos)
}

fn decode_block(bits: &mut Bits, dc: &Huffman, ac: &Huffman, last_dc: &mut i32, block: &mut [i16; 64]) -> Option<()> {
    let s = bits.decode(dc)?;
    let diff = extend(bits.bits(u32::from(s)), s);
    *last_dc = last_dc.checked_add(diff)?;
    block[0] = *last_dc as i16;
    let mut k = 1;
    while k < 64 {
        if bits.n < 16 {
            bits.fill();
        }
        let (value, run, len) = ac.fast_ac[(bits.acc >> (64 - FAST_BITS)) as usize];
        if len > 0 {
            bits.acc <<= len;
            bits.n -= u32::from(len);
            k += usize::from(run);
            block[NATURAL[k]] = value;
            k += 1;
            continue;
        }
        let rs = bits.decode(ac)?;
        let (r, s) = (usize::from(rs >> 4), rs & 15);
        if s != 0 {
            k += r;
            block[NATURAL[k]] = extend(bits.bits(u32::from(s)), s) as i16;
        } else if r != 15 {
            break;
        } else {
            k += 15;
        }
        k += 1;
    }
    Some(())
}

fn dc_first(bits: &mut Bits, dc: &Huffman, last_dc: &mut i32, block: &mut [i16; 64], al: u32) -> Option<()> {
    let s = bits.decode(dc)?;
    let diff = extend(bits.bits(u32::from(s)), s);
    *last_dc = last_dc.checked_add(diff)?;
    block[0] = ((*last_dc as u32) << al) as i16;
    Some(())
}

fn ac_first(
    bits: &mut Bits,
    ac: &Huffman,
    block: &mut [i16; 64],
    ss: usize,
    se: usize,
    al: u32,
    eobrun: &mut u32,
) -> Option<()> {
    if *eobrun > 0 {
        *eobrun -= 1;
        return Some(());
    }
    let mut k = ss;
    while k <= se {
        let rs = bits.decode(ac)?;
        let (r, s) = (u32::from(rs >> 4), rs & 15);
        if s != 0 {
            k += r as usize;
            block[NATURAL[k]] = ((extend(bits.bits(u32::from(s)), s) as u32) << al) as i16;
        } else if r == 15 {
            k += 15;
        } else {
            *eobrun = (1 << r) + bits.bits(r) as u32 - 1;
            break;
        }
        k += 1;
    }
    Some(())
}

fn ac_refine(
    bits: &mut Bits,
    ac: &Huffman,
    block: &mut [i16; 64],
    ss: usize,
    se: usize,
    al: u32,
    eobrun: &mut u32,
) -> Option<()> {
    let (p1, m1) = (1i16 << al, (-1i16) << al);
    let refine = |bits: &mut Bits, coef: &mut i16| {
        if bits.bit() && *coef & p1 == 0 {
            // libjpeg adds in int and stores a short: a corrupt scan wraps, never traps.
            *coef = coef.wrapping_add(if *coef >= 0 { p1 } else { m1 });
        }
    };
    let mut k = ss;
    if *eobrun == 0 {
        while k <= se {
            let rs = bits.decode(ac)?;
            let (mut r, s) = (i32::from(rs >> 4), rs & 15);
            let mut value = 0;
            if s != 0 {
                value = if bits.bit() { p1 } else { m1 };
            } else if r != 15 {
                *eobrun = (1u32 << r) + bits.bits(r as u32) as u32;
                break;
            }
            while k <= se {
                let coef = &mut block[NATURAL[k]];
                if *coef != 0 {
                    refine(bits, coef);
                } else {
                    r -= 1;
                    if r < 0 {
                        break;
                    }
                }
                k += 1;
            }
            if value != 0 {
                block[NATURAL[k]] = value;
            }
            k += 1;
        }
    }
    if *eobrun > 0 {
        while k <= se {
            let coef = &mut block[NATURAL[k]];
            if *coef != 0 {
                refine(bits, coef);
            }
            k += 1;
        }
        *eobrun -= 1;
    }
    Some(())
}

/// libjpeg's post-IDCT range limit: `x + 128` clamped for |x| < 512, wrapping beyond.
fn range_limit(x: i64) -> u8 {
    let i = (x & 1023) as i32;
    match i {
        0..128 => (i + 128) as u8,
        128..512 => 255,
        512..896 => 0,
        _ => (i - 896) as u8,
    }
}

dispatch!(
    /// `jpeg_idct_islow` (`jidctint.c`) of every block holding image data, into a plane of
    /// `width_in_blocks · 8 × height_in_blocks · 8` samples.
    idct_plane(c: &Component) -> Option<Vec<u8>> => idct_plane_kernel
);

#[inline(always)]
fn idct_plane_kernel(c: &Component) -> Option<Vec<u8>> {
    let q = c.quant?;
    let pw = c.width_in_blocks * 8;
    let mut plane = vec![0u8; pw * c.height_in_blocks * 8];
    for by in 0..c.height_in_blocks {
        for bx in 0..c.width_in_blocks {
            let block: &[i16; 64] = c.coefs[(by * c.bw + bx) * 64..][..64].try_into().ok()?;
            let rows = idct_block_i32(block, &q).unwrap_or_else(|| idct_block_i64(block, &q));
            for (r, row) in rows.iter().enumerate() {
                plane[(by * 8 + r) * pw + bx * 8..][..8].copy_from_slice(row);
            }
        }
    }
    Some(plane)
}

const CONST_BITS: u32 = 13;
const PASS1_BITS: u32 = 2;

/// One block in 32-bit lanes, 8 columns (then 8 rows) at a time, as libjpeg-turbo's SIMD
/// IDCT computes it. `None` when a dequantised coefficient reaches 2¹² or a first-pass
/// value 2¹³ (far outside what 8-bit images produce): within those bounds no sum of the
/// algorithm reaches 2³¹, so the result is the exact one (`idct_block_i64`'s).
#[inline(always)]
fn idct_block_i32(block: &[i16; 64], q: &[u16; 64]) -> Option<[[u8; 8]; 8]> {
    let mut x = [[0i32; 8]; 8];
    let mut out_of_range = false;
    for (i, (&c, &q)) in block.iter().zip(q).enumerate() {
        let v = i32::from(c) * i32::from(q);
        out_of_range |= (v + (1 << 12)) as u32 >= 1 << 13;
        x[i / 8][i % 8] = v;
    }
    if out_of_range {
        return None;
    }
    // Pass 1 down the columns: lane = column.
    let mut ws = [[0i32; 8]; 8];
    for col in 0..8 {
        let out = idct_1d_i32(|r| x[r][col], CONST_BITS);
        for r in 0..8 {
            let v = (out[r] + (1 << (CONST_BITS - PASS1_BITS - 1))) >> (CONST_BITS - PASS1_BITS);
            out_of_range |= (v + (1 << 13)) as u32 >= 1 << 14;
            ws[r][col] = v;
        }
    }
    if out_of_range {
        return None;
    }
    // Pass 2 along the rows: transposed, so that lane = row.
    let mut wt = [[0i32; 8]; 8];
    for (r, row) in ws.iter().enumerate() {
        for (k, &v) in row.iter().enumerate() {
            wt[k][r] = v;
        }
    }
    let mut rows = [[0u8; 8]; 8];
    let shift = CONST_BITS + PASS1_BITS + 3;
    for r in 0..8 {
        let out = idct_1d_i32(|k| wt[k][r], CONST_BITS);
        for k in 0..8 {
            rows[r][k] = range_limit_i32((out[k] + (1 << (shift - 1))) >> shift);
        }
    }
    Some(rows)
}

/// The same block in 64-bit arithmetic, for any coefficients (libjpeg's C IDCT with a
/// 64-bit `JLONG`).
fn idct_block_i64(block: &[i16; 64], q: &[u16; 64]) -> [[u8; 8]; 8] {
    let descale = |x: i64, n: u32| (x + (1 << (n - 1))) >> n;
    let deq = |i: usize| i64::from(block[i]) * i64::from(q[i]);
    let mut ws = [0i64; 64];
    for col in 0..8 {
        let out = idct_1d(|r| deq(r * 8 + col), CONST_BITS);
        for r in 0..8 {
            ws[r * 8 + col] = descale(out[r], CONST_BITS - PASS1_BITS);
        }
    }
    let mut rows = [[0u8; 8]; 8];
    for (row, dst) in rows.iter_mut().enumerate() {
        let out = idct_1d(|i| ws[row * 8 + i], CONST_BITS);
        for (d, &v) in dst.iter_mut().zip(&out) {
            *d = range_limit(descale(v, CONST_BITS + PASS1_BITS + 3));
        }
    }
    rows
}

/// [`range_limit`] on 32 bits, branch-free so that it vectorises.
#[inline(always)]
fn range_limit_i32(x: i32) -> u8 {
    let i = x & 1023;
    (if i < 128 {
        i + 128
    } else if i < 512 {
        255
    } else if i < 896 {
        0
    } else {
        i - 896
    }) as u8
}

/// One 8-point pass of `jidctint.c` (the `tmp10 ± tmp3`, … outputs, before descaling),
/// in 64 bits ([`idct_1d`]) and in 32 ([`idct_1d_i32`]; see [`idct_block_i32`] for why
/// nothing overflows there): the same text for both.
macro_rules! idct_1d {
    ($name:ident, $t:ty) => {
        #[inline(always)]
        fn $name(x: impl Fn(usize) -> $t, const_bits: u32) -> [$t; 8] {
            const FIX_0_298631336: $t = 2446;
            const FIX_0_390180644: $t = 3196;
            const FIX_0_541196100: $t = 4433;
            const FIX_0_765366865: $t = 6270;
            const FIX_0_899976223: $t = 7373;
            const FIX_1_175875602: $t = 9633;
            const FIX_1_501321110: $t = 12299;
            const FIX_1_847759065: $t = 15137;
            const FIX_1_961570560: $t = 16069;
            const FIX_2_053119869: $t = 16819;
            const FIX_2_562915447: $t = 20995;
            const FIX_3_072711026: $t = 25172;
            let (z2, z3) = (x(2), x(6));
            let z1 = (z2 + z3) * FIX_0_541196100;
            let tmp2 = z1 + z3 * -FIX_1_847759065;
            let tmp3 = z1 + z2 * FIX_0_765366865;
            let (z2, z3) = (x(0), x(4));
            let tmp0 = (z2 + z3) << const_bits;
            let tmp1 = (z2 - z3) << const_bits;
            let (tmp10, tmp13, tmp11, tmp12) = (tmp0 + tmp3, tmp0 - tmp3, tmp1 + tmp2, tmp1 - tmp2);
            let (t0, t1, t2, t3) = (x(7), x(5), x(3), x(1));
            let (z1, z2, z3, z4) = (t0 + t3, t1 + t2, t0 + t2, t1 + t3);
            let z5 = (z3 + z4) * FIX_1_175875602;
            let (t0, t1, t2, t3) =
                (t0 * FIX_0_298631336, t1 * FIX_2_053119869, t2 * FIX_3_072711026, t3 * FIX_1_501321110);
            let (z1, z2) = (z1 * -FIX_0_899976223, z2 * -FIX_2_562915447);
            let (z3, z4) = (z3 * -FIX_1_961570560 + z5, z4 * -FIX_0_390180644 + z5);
            let (t0, t1, t2, t3) = (t0 + z1 + z3, t1 + z2 + z4, t2 + z2 + z3, t3 + z1 + z4);
            [tmp10 + t3, tmp11 + t2, tmp12 + t1, tmp13 + t0, tmp13 - t0, tmp12 - t1, tmp11 - t2, tmp10 - t3]
        }
    };
}
idct_1d!(idct_1d, i64);
idct_1d!(idct_1d_i32, i32);

/// Scratch of one component's [`upsample_row`]: the output row, and the filters' sums and
/// doubled row.
struct UpsampleRow {
    row: Vec<u8>,
    sums: Vec<i32>,
    wide: Vec<u8>,
}

impl UpsampleRow {
    fn new(dw: usize, width: usize) -> Self {
        UpsampleRow { row: vec![0; width], sums: vec![0; dw], wide: vec![0; 2 * dw] }
    }
}

/// Output row `oy` of a component, upsampled to the image width as libjpeg-turbo does:
/// nothing at full size (the plane's own row); fancy (triangle) filters for 2:1
/// horizontally (`h2v1`, when the component is more than 2 samples wide), vertically
/// (`h1v2`) or both (`h2v2`, same width condition); replication for other integral
/// factors (the caller has refused fractional ones). Samples past the component's real
/// size are not read: vertical neighbours are clamped to its first and last real rows.
fn upsample_row<'a>(f: &Frame, c: &Component, plane: &'a [u8], oy: usize, s: &'a mut UpsampleRow) -> &'a [u8] {
    let (hx, vx) = (f.max_h / c.h, f.max_v / c.v);
    let (pw, w) = (c.width_in_blocks * 8, f.width);
    let y = oy / vx;
    if (hx, vx) == (1, 1) {
        return &plane[y * pw..][..w];
    }
    upsample_into(f, c, plane, oy, s);
    &s.row
}

dispatch!(
    /// [`upsample_row`]'s filters into `s.row`.
    upsample_into(f: &Frame, c: &Component, plane: &[u8], oy: usize, s: &mut UpsampleRow) -> () => upsample_kernel
);

#[inline(always)]
fn upsample_kernel(f: &Frame, c: &Component, plane: &[u8], oy: usize, s: &mut UpsampleRow) {
    let (hx, vx) = (f.max_h / c.h, f.max_v / c.v);
    let (pw, dw, dh, w) = (c.width_in_blocks * 8, c.dw, c.dh, f.width);
    let row_of = |y: usize| &plane[y * pw..y * pw + dw];
    let fancy_h = hx == 2 && dw > 2;
    let UpsampleRow { row, sums, wide } = s;
    let y = oy / vx;
    // The next-nearest row for 2:1 vertical filters, and whether this is the lower output row.
    let lower = oy % 2 == 1;
    let near = if lower { (y + 1).min(dh - 1) } else { y.saturating_sub(1) };
    match (hx, vx) {
        (2, 2) if fancy_h => {
            for ((s, &a), &b) in sums.iter_mut().zip(row_of(y)).zip(row_of(near)) {
                *s = i32::from(a) * 3 + i32::from(b);
            }
            // The edges repeat their own column; the interior has no branch, so it vectorises.
            wide[0] = ((sums[0] * 4 + 8) >> 4) as u8;
            wide[2 * dw - 1] = ((sums[dw - 1] * 4 + 7) >> 4) as u8;
            wide[1] = ((sums[0] * 3 + sums[1] + 7) >> 4) as u8;
            wide[2 * dw - 2] = ((sums[dw - 1] * 3 + sums[dw - 2] + 8) >> 4) as u8;
            for ((pair, s), (&left, &right)) in
                wide[2..2 * dw - 2].chunks_exact_mut(2).zip(&sums[1..dw - 1]).zip(sums[..dw - 2].iter().zip(&sums[2..]))
            {
                pair[0] = ((s * 3 + left + 8) >> 4) as u8;
                pair[1] = ((s * 3 + right + 7) >> 4) as u8;
            }
            row.copy_from_slice(&wide[..w]);
        }
        (1, 2) => {
            let bias = if lower { 2 } else { 1 };
            for ((o, &a), &b) in row.iter_mut().zip(row_of(y)).zip(row_of(near)) {
                *o = ((i32::from(a) * 3 + i32::from(b) + bias) >> 2) as u8;
            }
        }
        (2, 1) if fancy_h => {
            let src = row_of(y);
            for x in 0..dw {
                let this = i32::from(src[x]);
                wide[2 * x] = if x == 0 { src[0] } else { ((this * 3 + i32::from(src[x - 1]) + 1) >> 2) as u8 };
                wide[2 * x + 1] =
                    if x == dw - 1 { src[x] } else { ((this * 3 + i32::from(src[x + 1]) + 2) >> 2) as u8 };
            }
            row.copy_from_slice(&wide[..w]);
        }
        (1, _) => row.copy_from_slice(&row_of(y)[..w]),
        _ => {
            let src = row_of(y);
            for (ox, o) in row.iter_mut().enumerate() {
                *o = src[ox / hx];
            }
        }
    }
}

const FIX_0_71414: i32 = 46802;
const FIX_0_34414: i32 = 22554;

dispatch!(
    /// YCbCr planes to interleaved RGB, libjpeg's tables computed rather than looked up
    /// ([`ycc_to_rgb`]), 16 pixels at a time so that the arithmetic vectorises.
    ycc_rows(y: &[u8], cb: &[u8], cr: &[u8], rgb: &mut [u8]) -> () => ycc_rows_kernel
);

#[inline(always)]
fn ycc_rows_kernel(y: &[u8], cb: &[u8], cr: &[u8], rgb: &mut [u8]) {
    const N: usize = 16;
    let clamp = |v: i32| v.clamp(0, 255) as u8;
    let pixel = |y: u8, cb: u8, cr: u8| ycc_to_rgb(y, cb, cr).map(clamp);
    let mut px = rgb.chunks_exact_mut(3 * N);
    let (mut ys, mut cbs, mut crs) = (y.chunks_exact(N), cb.chunks_exact(N), cr.chunks_exact(N));
    for (((p, y), cb), cr) in (&mut px).zip(&mut ys).zip(&mut cbs).zip(&mut crs) {
        let mut out = [[0u8; 3]; N];
        for i in 0..N {
            out[i] = pixel(y[i], cb[i], cr[i]);
        }
        p.copy_from_slice(out.as_flattened());
    }
    let rest = px.into_remainder().chunks_exact_mut(3);
    for (p, ((&y, &cb), &cr)) in rest.zip(ys.remainder().iter().zip(cbs.remainder()).zip(crs.remainder())) {
        p.copy_from_slice(&pixel(y, cb, cr));
    }
}

/// One row of the components (already at full width) to RGB: grey replicated; YCbCr
/// through libjpeg's tables unless libjpeg decides the image is RGB; CMYK / YCCK through
/// Pillow's CMYK → RGB.
fn row_to_rgb(rows: &[&[u8]], is_rgb: bool, ycck: bool, rgb: &mut [u8]) {
    let px = rgb.chunks_exact_mut(3);
    match *rows {
        [g] => px.zip(g).for_each(|(p, &v)| p.fill(v)),
        [a, b, c] if is_rgb => {
            px.zip(a.iter().zip(b).zip(c)).for_each(|(p, ((&a, &b), &c))| p.copy_from_slice(&[a, b, c]))
        }
        [y, cb, cr] => ycc_rows(y, cb, cr, rgb),
        [c, m, y, k] => {
            for (i, p) in px.enumerate() {
                let stored = [c[i], m[i], y[i], k[i]];
                p.copy_from_slice(&pillow_cmyk(if ycck { ycck_to_cmyk(stored) } else { stored }));
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn idct_in_32_bits_is_exact() {
        // Random blocks with coefficients up to the 32-bit path's bound, sparse and dense,
        // with libjpeg's default and 16-bit quantisers: the same samples as in 64 bits, or
        // a refusal (then the 64-bit path runs).
        let mut seed = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let (mut exact, mut refused) = (0, 0);
        for round in 0..20_000 {
            let q: [u16; 64] = std::array::from_fn(|_| if round % 3 == 0 { 1 } else { 1 + (next() % 64) as u16 });
            let keep = 1 + next() % 64;
            let block: [i16; 64] = std::array::from_fn(|_| {
                if next() % 64 < keep { ((next() % 8192) as i32 - 4096) as i16 / (1 + (next() % 16) as i16) } else { 0 }
            });
            match idct_block_i32(&block, &q) {
                Some(rows) => {
                    assert_eq!(rows, idct_block_i64(&block, &q), "round {round}");
                    exact += 1;
                }
                None => refused += 1,
            }
        }
        assert!(exact > 1_000 && refused > 100, "{exact} exact, {refused} refused");
        for x in -5000..5000 {
            assert_eq!(range_limit_i32(x), range_limit(i64::from(x)), "{x}");
        }
    }

    #[test]
    fn tables() {
        // Values from libjpeg's tables: Cr=255 → +178 red, Cb=0 → -227 blue.
        assert_eq!(ycc_to_rgb(100, 128, 128), [100, 100, 100]);
        assert_eq!(ycc_to_rgb(0, 128, 255)[0], 178);
        assert_eq!(ycc_to_rgb(0, 0, 128)[2], -227);
        assert_eq!((range_limit(-128), range_limit(0), range_limit(127), range_limit(300)), (0, 128, 255, 255));
        // Within ±512 it clamps; beyond, it wraps as libjpeg's table does (corrupt data only).
        assert_eq!((range_limit(-129), range_limit(-512), range_limit(-600)), (0, 0, 255));
    }

    #[test]
    fn cmyk_formula() {
        // No ink: white; full black ink (stored 0): black; full cyan ink: R = 0.
        assert_eq!(pillow_cmyk([255, 255, 255, 255]), [255; 3]);
        assert_eq!(pillow_cmyk([255, 255, 255, 0]), [0; 3]);
        assert_eq!(pillow_cmyk([0, 255, 255, 255]), [0, 255, 255]);
    }

    /// The fixtures' JPEGs all take this decoder's path (none falls back).
    #[test]
    fn fixtures_need_no_fallback() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/images");
        let mut n = 0;
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "jpg") {
                assert!(decode(&std::fs::read(&path).unwrap(), 1 << 24).is_some(), "{}", path.display());
                n += 1;
            }
        }
        assert!(n >= 30, "{n} JPEG fixtures");
    }

    #[test]
    fn hostile_headers_do_not_panic() {
        let mut j = vec![0xff, 0xd8, 0xff, 0xc0, 0, 11, 8, 0, 1, 0, 1, 1, 1, 0x11, 0];
        j.extend([0xff, 0xda, 0, 8, 1, 1, 0, 0, 63, 0, 0xff, 0xd9]);
        assert!(decode(&j, 1 << 20).is_none(), "no tables");
        assert!(decode(b"\xff\xd8", 1 << 20).is_none());
        assert!(decode(b"", 1 << 20).is_none());
    }
}

//! Byte sizes on the command line: `4GiB`, `512MiB`, `64KiB`, `1G`, `1000000`.

use std::fmt;
use std::str::FromStr;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteSize(pub u64);

impl FromStr for ByteSize {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, String> {
        let t = s.trim();
        let split = t.find(|c: char| !c.is_ascii_digit() && c != '.').unwrap_or(t.len());
        let (num, unit) = t.split_at(split);
        let num: f64 = num.parse().map_err(|_| format!("{s:?} is not a size (e.g. 4GiB, 512MiB, 1000000)"))?;
        let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
            "" | "b" => 1,
            "k" | "kb" => 1000,
            "kib" => 1 << 10,
            "m" | "mb" => 1_000_000,
            "mib" => 1 << 20,
            "g" | "gb" => 1_000_000_000,
            "gib" => 1 << 30,
            "t" | "tb" => 1_000_000_000_000,
            "tib" => 1 << 40,
            other => return Err(format!("unknown size unit {other:?} in {s:?}")),
        };
        let bytes = num * mult as f64;
        if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
            return Err(format!("{s:?} is out of range"));
        }
        Ok(ByteSize(bytes as u64))
    }
}

impl fmt::Display for ByteSize {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let b = self.0;
        match b {
            _ if b >= 1 << 30 && b.is_multiple_of(1 << 30) => write!(f, "{}GiB", b >> 30),
            _ if b >= 1 << 20 && b.is_multiple_of(1 << 20) => write!(f, "{}MiB", b >> 20),
            _ if b >= 1 << 10 && b.is_multiple_of(1 << 10) => write!(f, "{}KiB", b >> 10),
            _ => write!(f, "{b}"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_sizes() {
        assert_eq!("4GiB".parse(), Ok(ByteSize(4 << 30)));
        assert_eq!("512 MiB".parse(), Ok(ByteSize(512 << 20)));
        assert_eq!("1.5k".parse(), Ok(ByteSize(1500)));
        assert_eq!("123".parse(), Ok(ByteSize(123)));
        assert!("GiB".parse::<ByteSize>().is_err());
        assert!("4 parsecs".parse::<ByteSize>().is_err());
        assert_eq!(ByteSize(4 << 30).to_string(), "4GiB");
    }
}

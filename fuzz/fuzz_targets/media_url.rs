#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mmserve_fuzz::media_url(data));

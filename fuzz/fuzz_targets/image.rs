#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| mmserve_fuzz::image(data));

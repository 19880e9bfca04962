//! Media items of a request: fetched (here: `data:` URLs), checked, decoded off the
//! event loop, and keyed for the embed cache.

use base64::Engine as _;
use mmserve_media::{ImageLimits, decode_image};
use mmserve_protocol::{ItemDigest, Modality};

use crate::error::ApiError;

/// An item ready for the cache: its bytes and key.
pub struct MediaItem {
    pub bytes: Vec<u8>,
    pub digest: ItemDigest,
    pub modality: Modality,
    pub token_num: u32,
}

/// Limits checked before any expensive work.
#[derive(Debug, Clone)]
pub struct MediaLimits {
    pub max_item_bytes: usize,
    pub max_items: usize,
    pub image: ImageLimits,
}

/// Decodes a `data:` URL's payload. Only base64 payloads are accepted.
pub fn data_url_bytes(url: &str, max_bytes: usize) -> Result<Vec<u8>, ApiError> {
    let param = "image_url";
    let Some(rest) = url.strip_prefix("data:") else {
        let scheme = url.split(':').next().unwrap_or("");
        return Err(ApiError::bad_param(
            param,
            format!("image URLs with scheme {scheme:?} are not allowed; send the image as a data: URL (base64)"),
        ));
    };
    let (meta, payload) =
        rest.split_once(',').ok_or_else(|| ApiError::bad_param(param, "malformed data: URL (no comma)"))?;
    if !meta.ends_with(";base64") {
        return Err(ApiError::bad_param(param, "data: URLs must be base64-encoded (`;base64,`)"));
    }
    // Base64 of n bytes is 4n/3 characters: refuse oversized items before decoding.
    if payload.len() / 4 * 3 > max_bytes + 3 {
        return Err(ApiError::bad_param(param, format!("the image is larger than the limit of {max_bytes} bytes")));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(payload.trim_end())
        .map_err(|e| ApiError::bad_param(param, format!("invalid base64 in data: URL: {e}")))?;
    if bytes.len() > max_bytes {
        return Err(ApiError::bad_param(param, format!("the image is larger than the limit of {max_bytes} bytes")));
    }
    if bytes.is_empty() {
        return Err(ApiError::bad_param(param, "the image is empty"));
    }
    Ok(bytes)
}

/// Checks that the bytes are a decodable image within the limits, on a blocking thread.
pub async fn check_image(bytes: Vec<u8>, limits: ImageLimits) -> Result<Vec<u8>, ApiError> {
    tokio::task::spawn_blocking(move || decode_image(&bytes, &limits).map(|_| bytes))
        .await
        .map_err(|e| ApiError::Internal(format!("image check task: {e}")))?
        .map_err(|e| ApiError::bad_param("image_url", e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_urls() {
        assert_eq!(data_url_bytes("data:image/png;base64,AAEC", 10).unwrap(), vec![0, 1, 2]);
        for bad in ["http://x/y.png", "data:image/png,raw", "data:image/png;base64,@@@", "data:image/png;base64"] {
            assert!(matches!(data_url_bytes(bad, 10), Err(ApiError::BadRequest { .. })), "{bad}");
        }
        assert!(data_url_bytes("data:image/png;base64,AAAAAAAAAAAA", 4).is_err(), "over the byte limit");
    }
}

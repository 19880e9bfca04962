//! Reading a sample from Prometheus' text format (`/metrics`), for the clients that
//! report a server's counters (`bench`, `caption`).

/// The value of the first sample of series `name` (any labels).
pub fn sample(text: &str, name: &str) -> Option<f64> {
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(name)?;
        let rest = match rest.strip_prefix('{') {
            Some(labels) => labels.split_once("} ")?.1,
            None => rest.strip_prefix(' ')?,
        };
        rest.trim().parse().ok()
    })
}

#[cfg(test)]
mod tests {
    use super::sample;

    #[test]
    fn reads_plain_and_labelled_samples_and_not_longer_names() {
        let text = "# TYPE a counter\na_total_x 9\na_total{model_name=\"m\"} 3\nb 1.5\n";
        assert_eq!(sample(text, "a_total"), Some(3.0));
        assert_eq!(sample(text, "b"), Some(1.5));
        assert_eq!(sample(text, "c"), None);
    }
}

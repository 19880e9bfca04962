//! Log output of every process: `MMSERVE_LOG` filters (an `EnvFilter` directive such as
//! `info` or `warn,mmserve_api=debug`; default `info`), `--log-format` (or
//! `MMSERVE_LOG_FORMAT`) picks human-readable lines or one JSON object a line; colour
//! only when stderr is a terminal. `serve` hands its format to its children.

use std::io::IsTerminal;
use std::sync::OnceLock;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    /// `time level target: message key=value …`.
    #[default]
    Text,
    /// One JSON object a line: timestamp, level, target, fields (the request id among
    /// them), and the spans it happened in.
    Json,
}

impl LogFormat {
    pub fn name(self) -> &'static str {
        match self {
            LogFormat::Text => "text",
            LogFormat::Json => "json",
        }
    }
}

static FORMAT: OnceLock<LogFormat> = OnceLock::new();

/// Installs the process's subscriber (once).
pub fn init(format: LogFormat) {
    let _ = FORMAT.set(format);
    let filter = tracing_subscriber::EnvFilter::try_from_env("MMSERVE_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt().with_writer(std::io::stderr).with_env_filter(filter);
    match format {
        LogFormat::Text => builder.with_ansi(std::io::stderr().is_terminal()).init(),
        LogFormat::Json => builder.json().with_current_span(true).with_span_list(false).init(),
    }
}

/// The format this process logs in.
pub fn format() -> LogFormat {
    FORMAT.get().copied().unwrap_or_default()
}

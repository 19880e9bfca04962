//! One configuration for a run.
//!
//! Every setting of every service is a flag of that service's subcommand (with an
//! `MMSERVE_*` variable), and also a flag of `serve`, which adds each child's settings
//! to its own command once (a setting two services share, `--device` say, is one flag
//! that sets both). A TOML file (`--config FILE`) may hold a `[serve]` section (what the
//! command line of `serve` would say) and one section per service (`[embed-cache]`,
//! `[encoder]`, `[engine]`, `[api]`), keyed by setting name (`max_batch` or
//! `max-batch`). Precedence, highest first: flags and variables, the service's section,
//! `[serve]`, the default.
//!
//! `serve` resolves each child's section, validates it with the child's own flag
//! parsers before starting anything, writes the resolved configuration into the run's
//! directory, and starts each child with `--config` pointing at it, plus the run's
//! wiring (sockets, shared-memory prefix, the model), with no other `MMSERVE_*`
//! variable: a child's settings are the file's, whole. `serve --print-config` prints
//! the same file.

use std::collections::HashSet;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{Context, anyhow, bail};
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches, Command};

/// The services' sections, in start order.
pub const SECTIONS: [&str; 4] = ["embed-cache", "encoder", "engine", "api"];

/// Flags `serve` sets for each run (sockets, names, the model): not settings of a section.
const WIRING: &[&str] =
    &["socket", "cache_socket", "encoder_socket", "engine_socket", "shm_prefix", "embed_dim", "embed_dtype", "model"];

/// Never written to a file or printed; `serve` hands it on in the environment.
const SECRETS: &[&str] = &["admin_token", "api_key"];

/// Arguments that are not settings at all.
const NOT_SETTINGS: &[&str] = &["help", "version", "config", "print_config"];

/// `--config FILE`.
pub fn config_arg(help: &'static str) -> Arg {
    Arg::new("config")
        .long("config")
        .env("MMSERVE_CONFIG")
        .value_name("FILE")
        .value_parser(clap::value_parser!(PathBuf))
        .help(help)
}

fn id(arg: &Arg) -> &str {
    arg.get_id().as_str()
}

/// A setting's name in a file: its flag, with `_` for `-` (`--max-batch` → `max_batch`).
fn key(arg: &Arg) -> String {
    arg.get_long().unwrap_or(id(arg)).replace('-', "_")
}

/// Whether `arg` is a setting of a service section (what a section file may hold).
fn is_section_setting(arg: &Arg) -> bool {
    let id = id(arg);
    !(WIRING.contains(&id) || SECRETS.contains(&id) || NOT_SETTINGS.contains(&id))
}

/// `serve`'s command with every child's settings added, once each, under a heading
/// that names the services it sets.
pub fn with_child_settings(mut serve: Command, children: &[Command]) -> Command {
    let mut added: Vec<(Arg, Vec<&str>)> = Vec::new();
    for child in children {
        for arg in child.get_arguments().filter(|a| is_section_setting(a) || SECRETS.contains(&id(a))) {
            if serve.get_arguments().any(|a| id(a) == id(arg)) {
                continue;
            }
            match added.iter_mut().find(|(a, _)| id(a) == id(arg)) {
                Some((_, owners)) => owners.push(child.get_name()),
                None => added.push((arg.clone(), vec![child.get_name()])),
            }
        }
    }
    for (arg, owners) in added {
        serve = serve.arg(arg.help_heading(format!("Settings of {}", owners.join(" and "))));
    }
    serve
}

/// A TOML file of settings; unknown sections are refused.
pub fn load(path: &Path) -> anyhow::Result<toml::Table> {
    let text = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let table: toml::Table = text.parse().with_context(|| format!("{}: not TOML", path.display()))?;
    for (name, value) in &table {
        if name != "serve" && !SECTIONS.contains(&name.as_str()) {
            bail!("{}: unknown section [{name}] (known: serve, {})", path.display(), SECTIONS.join(", "));
        }
        if !value.is_table() {
            bail!("{}: `{name}` must be a section ([{name}])", path.display());
        }
    }
    Ok(table)
}

/// The entries of section `name` of `file`, keys normalised to setting ids
/// (`max-batch` → `max_batch`), each checked against `cmd`'s arguments and `allowed`.
fn section<'a>(
    file: &'a toml::Table,
    name: &str,
    cmd: &'a Command,
    allowed: impl Fn(&Arg) -> bool,
) -> anyhow::Result<Vec<(&'a Arg, &'a toml::Value)>> {
    let Some(entries) = file.get(name).and_then(toml::Value::as_table) else { return Ok(Vec::new()) };
    let mut out = Vec::new();
    for (key, value) in entries {
        let key_id = key.replace('-', "_");
        let arg = cmd.get_arguments().find(|a| self::key(a) == key_id);
        match arg {
            Some(arg) if allowed(arg) => out.push((arg, value)),
            Some(_) if SECRETS.contains(&key_id.as_str()) => {
                bail!("[{name}] {key}: a secret is not read from a file (use its variable or its _file setting)")
            }
            Some(_) if WIRING.contains(&key_id.as_str()) => {
                bail!("[{name}] {key}: set by `serve` for each run (set `model` in [serve])")
            }
            _ => bail!("[{name}] {key}: no such setting of `mmserve {}`", cmd.get_name()),
        }
    }
    Ok(out)
}

/// The flags that set `arg` to the TOML `value`.
fn value_flags(arg: &Arg, value: &toml::Value) -> anyhow::Result<Vec<String>> {
    let long = arg.get_long().ok_or_else(|| anyhow!("{} has no flag", id(arg)))?;
    let scalar = |v: &toml::Value| -> anyhow::Result<String> {
        Ok(match v {
            toml::Value::String(s) => s.clone(),
            toml::Value::Integer(n) => n.to_string(),
            toml::Value::Float(x) => x.to_string(),
            toml::Value::Boolean(b) => b.to_string(),
            other => bail!("{}: {} is not a value for it", id(arg), other.type_str()),
        })
    };
    match (arg.get_action(), value) {
        (ArgAction::SetTrue, toml::Value::Boolean(true)) => Ok(vec![format!("--{long}")]),
        (ArgAction::SetTrue, toml::Value::Boolean(false)) => Ok(Vec::new()),
        (ArgAction::SetTrue, _) => bail!("{}: true or false", id(arg)),
        (ArgAction::Append, toml::Value::Array(items)) => {
            items.iter().map(|v| Ok(format!("--{long}={}", scalar(v)?))).collect()
        }
        (_, toml::Value::Array(_)) => bail!("{}: one value, not a list", id(arg)),
        (_, v) => Ok(vec![format!("--{long}={}", scalar(v)?)]),
    }
}

/// The flags that give `arg` the value it has in `m` (raw, as typed or defaulted).
fn raw_flags(arg: &Arg, m: &ArgMatches) -> Vec<String> {
    let Some(long) = arg.get_long() else { return Vec::new() };
    let Some(raw) = m.get_raw(id(arg)) else { return Vec::new() };
    let values: Vec<String> = raw.map(|v| v.to_string_lossy().into_owned()).collect();
    match arg.get_action() {
        ArgAction::SetTrue => match values.first().map(String::as_str) {
            Some("true") => vec![format!("--{long}")],
            _ => Vec::new(),
        },
        _ => values.into_iter().map(|v| format!("--{long}={v}")).collect(),
    }
}

fn given(m: &ArgMatches, id: &str) -> bool {
    matches!(m.value_source(id), Some(ValueSource::CommandLine | ValueSource::EnvVariable))
}

/// For a service run on its own (or by `serve`): the flags that section `name` of
/// `file` contributes to `cmd`, for settings not given as flags or variables, and
/// their ids.
pub fn file_flags(
    cmd: &Command,
    m: &ArgMatches,
    file: &toml::Table,
    name: &str,
) -> anyhow::Result<(Vec<OsString>, HashSet<String>)> {
    let allowed = |a: &Arg| !NOT_SETTINGS.contains(&id(a)) && !SECRETS.contains(&id(a));
    let mut flags = Vec::new();
    let mut ids = HashSet::new();
    for (arg, value) in section(file, name, cmd, allowed)? {
        if !given(m, id(arg)) {
            flags.extend(value_flags(arg, value).with_context(|| format!("[{name}]"))?.into_iter().map(OsString::from));
            ids.insert(id(arg).to_string());
        }
    }
    Ok((flags, ids))
}

/// `serve`'s resolved settings of one child, validated by the child's parsers.
pub struct ChildSection {
    pub name: String,
    cmd: Command,
    matches: ArgMatches,
}

/// Resolves every child's section from `serve`'s matches (`from_serve_file`: the ids
/// that `[serve]` of the file set) and the file's sections.
pub fn resolve_children(
    serve: &ArgMatches,
    from_serve_file: &HashSet<String>,
    file: Option<&toml::Table>,
    children: &[Command],
) -> anyhow::Result<Vec<ChildSection>> {
    let empty = toml::Table::new();
    let file = file.unwrap_or(&empty);
    let mut out = Vec::new();
    for child in children {
        let name = child.get_name();
        let own = section(file, name, child, is_section_setting)?;
        let mut argv: Vec<String> = vec![name.to_string()];
        // Placeholders for the run's wiring: only the settings are validated here.
        for arg in child.get_arguments().filter(|a| WIRING.contains(&id(a))) {
            let placeholder = match id(arg) {
                "embed_dim" => "1",
                "embed_dtype" => "float32",
                _ => "-",
            };
            argv.push(format!("--{}={placeholder}", arg.get_long().unwrap_or(id(arg))));
        }
        for arg in child.get_arguments().filter(|a| is_section_setting(a)) {
            let flags = match own.iter().find(|(a, _)| id(a) == id(arg)) {
                _ if given(serve, id(arg)) && !from_serve_file.contains(id(arg)) => raw_flags(arg, serve),
                Some((_, value)) => value_flags(arg, value).with_context(|| format!("[{name}]"))?,
                // `[serve]`'s value, or the default.
                None => raw_flags(arg, serve),
            };
            argv.extend(flags);
        }
        let matches = child.clone().try_get_matches_from(&argv).map_err(|e| {
            let message = e.render().to_string();
            let first = message.lines().next().unwrap_or_default().trim_start_matches("error: ").to_string();
            anyhow!("settings of {name}: {first}")
        })?;
        out.push(ChildSection { name: name.to_string(), cmd: child.clone(), matches });
    }
    Ok(out)
}

/// The TOML of one section: every setting of `cmd` with its value in `m`, in the
/// command's order; unset ones as comments.
pub fn section_toml(name: &str, cmd: &Command, m: &ArgMatches, settings: impl Fn(&Arg) -> bool) -> String {
    let mut out = format!("[{name}]\n");
    for arg in cmd.get_arguments().filter(|a| settings(a)) {
        let key = key(arg);
        let Some(raw) = m.get_raw(id(arg)) else {
            out.push_str(&format!("# {key} (unset)\n"));
            continue;
        };
        let values: Vec<toml::Value> = raw.map(|v| typed(arg, &v.to_string_lossy())).collect();
        let value = match arg.get_action() {
            ArgAction::Append => toml::Value::Array(values),
            _ => values.into_iter().next().unwrap_or(toml::Value::Array(Vec::new())),
        };
        out.push_str(&format!("{key} = {value}\n"));
    }
    out
}

/// A raw flag value as TOML: flags are booleans, numbers stay numbers, the rest strings.
fn typed(arg: &Arg, raw: &str) -> toml::Value {
    if matches!(arg.get_action(), ArgAction::SetTrue) {
        return toml::Value::Boolean(raw == "true");
    }
    if let Ok(n) = raw.parse::<i64>() {
        return toml::Value::Integer(n);
    }
    // Only plain decimal spellings: "inf", "nan" and the like stay strings.
    let decimal = raw.chars().all(|c| c.is_ascii_digit() || "+-.eE".contains(c));
    match raw.parse::<f64>() {
        Ok(x) if decimal => toml::Value::Float(x),
        _ => toml::Value::String(raw.to_string()),
    }
}

impl ChildSection {
    pub fn toml(&self) -> String {
        section_toml(&self.name, &self.cmd, &self.matches, is_section_setting)
    }
}

/// The whole resolved configuration: `[serve]`'s own settings, then each child's.
pub fn render(serve_cmd: &Command, serve: &ArgMatches, children: &[ChildSection]) -> String {
    let child_ids: HashSet<&str> =
        children.iter().flat_map(|c| c.cmd.get_arguments().map(id).collect::<Vec<_>>()).collect();
    // `[serve]` holds what only serve has (the model included); the rest is per child.
    let own = |a: &Arg| {
        let id = id(a);
        !NOT_SETTINGS.contains(&id) && !SECRETS.contains(&id) && (id == "model" || !child_ids.contains(id))
    };
    let mut out = section_toml("serve", serve_cmd, serve, own);
    for c in children {
        out.push('\n');
        out.push_str(&c.toml());
    }
    out
}

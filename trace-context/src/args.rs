//! The tracing flags, each read from its standard `OTEL_*` variable too
//! (the OpenTelemetry SDK environment specification).

use opentelemetry_sdk::trace::Sampler;

/// Which spans are recorded and exported (`OTEL_TRACES_SAMPLER`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum TracesSampler {
    /// Every span.
    #[value(name = "always_on")]
    AlwaysOn,
    /// No span.
    #[value(name = "always_off")]
    AlwaysOff,
    /// A fraction of traces (`--otel-traces-sampler-arg`), decided on the
    /// trace id.
    #[value(name = "traceidratio")]
    TraceIdRatio,
    /// As the parent says; a root span is recorded (the default).
    #[value(name = "parentbased_always_on")]
    ParentBasedAlwaysOn,
    /// As the parent says; a root span is not recorded.
    #[value(name = "parentbased_always_off")]
    ParentBasedAlwaysOff,
    /// As the parent says; a fraction of root spans.
    #[value(name = "parentbased_traceidratio")]
    ParentBasedTraceIdRatio,
}

/// Tracing flags: where spans go, under which service name, how many.
#[derive(Debug, Clone, clap::Args)]
pub struct TraceArgs {
    /// OTLP/HTTP collector base URL, e.g. http://localhost:4318: spans are
    /// POSTed as protobuf to URL/v1/traces (an OpenTelemetry Collector,
    /// Jaeger, Tempo). Unset: no span is made or exported, and a stored
    /// trace context is forwarded unchanged. Only http/protobuf is spoken
    /// (OTEL_EXPORTER_OTLP_PROTOCOL); extra headers come from
    /// OTEL_EXPORTER_OTLP_HEADERS.
    #[arg(
        long = "otlp-endpoint",
        env = "OTEL_EXPORTER_OTLP_ENDPOINT",
        value_name = "URL",
        help_heading = "Traces (OpenTelemetry)"
    )]
    pub otlp_endpoint: Option<String>,

    /// The full URL spans are POSTed to, used as it is (overrides
    /// --otlp-endpoint's URL/v1/traces).
    #[arg(
        long = "otlp-traces-endpoint",
        env = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        value_name = "URL",
        help_heading = "Traces (OpenTelemetry)"
    )]
    pub otlp_traces_endpoint: Option<String>,

    /// The `service.name` of this process's spans (default: the program's
    /// name).
    #[arg(
        long = "otel-service-name",
        env = "OTEL_SERVICE_NAME",
        value_name = "NAME",
        help_heading = "Traces (OpenTelemetry)"
    )]
    pub service_name: Option<String>,

    /// Which traces are recorded: always_on, always_off, traceidratio,
    /// parentbased_always_on (the default), parentbased_always_off,
    /// parentbased_traceidratio (any case). The parent-based samplers follow
    /// the sampled flag of the incoming (or stored) traceparent. As the
    /// OpenTelemetry specification asks, a value this SDK does not know (a
    /// sampler of another SDK, e.g. jaeger_remote) is logged and the default
    /// used, never an error.
    #[arg(
        long = "otel-traces-sampler",
        env = "OTEL_TRACES_SAMPLER",
        value_name = "SAMPLER",
        help_heading = "Traces (OpenTelemetry)"
    )]
    pub sampler: Option<String>,

    /// The ratio of the `*traceidratio` samplers, 0.0 to 1.0 (default 1.0;
    /// another value is logged and 1.0 used).
    #[arg(
        long = "otel-traces-sampler-arg",
        env = "OTEL_TRACES_SAMPLER_ARG",
        value_name = "RATIO",
        help_heading = "Traces (OpenTelemetry)"
    )]
    pub sampler_arg: Option<String>,

    /// A PEM file of CA certificates trusted for an https collector,
    /// besides the public roots (a private CA).
    #[arg(
        long = "otlp-certificate",
        env = "OTEL_EXPORTER_OTLP_CERTIFICATE",
        value_name = "FILE",
        help_heading = "Traces (OpenTelemetry)"
    )]
    pub certificate: Option<std::path::PathBuf>,

    /// Spans held for export at most: those queued, plus the batch (up to
    /// 512) being sent. A span ending while the queue is full (the
    /// collector slow or down) is dropped and counted, never waited for.
    /// About 1 KiB each (a trace's tracestate is kept to 512 bytes).
    #[arg(
        long = "otlp-queue-spans",
        env = "OTEL_BSP_MAX_QUEUE_SIZE",
        value_name = "N",
        default_value_t = 2048,
        value_parser = clap::value_parser!(u32).range(1..=1_000_000),
        help_heading = "Traces (OpenTelemetry)"
    )]
    pub queue_spans: u32,
}

impl TraceArgs {
    /// Where spans go: the traces URL, or `None` when tracing is off (no
    /// endpoint, or `OTEL_SDK_DISABLED=true`). Errors name the setting: a
    /// URL that is not `http(s)://host...`, or a protocol other than
    /// `http/protobuf`.
    pub fn traces_url(&self) -> Result<Option<String>, String> {
        if std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.trim().eq_ignore_ascii_case("true")) {
            return Ok(None);
        }
        let url = match (&self.otlp_traces_endpoint, &self.otlp_endpoint) {
            (Some(full), _) if !full.trim().is_empty() => {
                check_url(
                    full,
                    "--otlp-traces-endpoint (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT)",
                )?;
                full.trim().to_owned()
            }
            (_, Some(base)) if !base.trim().is_empty() => {
                check_url(base, "--otlp-endpoint (OTEL_EXPORTER_OTLP_ENDPOINT)")?;
                // The signal's path goes after the base URL's path, before
                // its query.
                let (base, query) = match base.trim().split_once('?') {
                    Some((b, q)) => (b, Some(q)),
                    None => (base.trim(), None),
                };
                let path = format!("{}/v1/traces", base.trim_end_matches('/'));
                match query {
                    Some(q) => format!("{path}?{q}"),
                    None => path,
                }
            }
            _ => return Ok(None),
        };
        for var in [
            "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ] {
            if let Ok(p) = std::env::var(var)
                && !p.trim().is_empty()
                && p.trim() != "http/protobuf"
            {
                return Err(format!(
                    "{var}={p}: only http/protobuf is supported (an OTLP/HTTP endpoint, port 4318 by default); unset it or set http/protobuf"
                ));
            }
        }
        Ok(Some(url))
    }

    /// The sampler the flags describe; a value it does not know is logged
    /// (WARN) and the default taken, as the OpenTelemetry specification
    /// asks of its environment variables.
    pub fn sampler(&self) -> Sampler {
        let kind = match self.sampler.as_deref().map(str::trim) {
            None | Some("") => TracesSampler::ParentBasedAlwaysOn,
            Some(name) => {
                <TracesSampler as clap::ValueEnum>::from_str(name, true).unwrap_or_else(|_| {
                    tracing::warn!(
                        sampler = name,
                        "--otel-traces-sampler (OTEL_TRACES_SAMPLER) names a sampler this process does not have; using parentbased_always_on"
                    );
                    TracesSampler::ParentBasedAlwaysOn
                })
            }
        };
        let ratio = match self.sampler_arg.as_deref().map(str::trim) {
            None | Some("") => 1.0,
            Some(arg) => ratio(arg).unwrap_or_else(|e| {
                if matches!(
                    kind,
                    TracesSampler::TraceIdRatio | TracesSampler::ParentBasedTraceIdRatio
                ) {
                    tracing::warn!(
                        "--otel-traces-sampler-arg (OTEL_TRACES_SAMPLER_ARG): {e}; using 1.0"
                    );
                }
                1.0
            }),
        };
        match kind {
            TracesSampler::AlwaysOn => Sampler::AlwaysOn,
            TracesSampler::AlwaysOff => Sampler::AlwaysOff,
            TracesSampler::TraceIdRatio => Sampler::TraceIdRatioBased(ratio),
            TracesSampler::ParentBasedAlwaysOn => Sampler::ParentBased(Box::new(Sampler::AlwaysOn)),
            TracesSampler::ParentBasedAlwaysOff => {
                Sampler::ParentBased(Box::new(Sampler::AlwaysOff))
            }
            TracesSampler::ParentBasedTraceIdRatio => {
                Sampler::ParentBased(Box::new(Sampler::TraceIdRatioBased(ratio)))
            }
        }
    }
}

fn check_url(url: &str, setting: &str) -> Result<(), String> {
    let parsed: http::Uri = url
        .trim()
        .parse()
        .map_err(|e| format!("invalid {setting} {:?}: {e}", crate::redact::url(url)))?;
    match (parsed.scheme_str(), parsed.host()) {
        (Some("http" | "https"), Some(_)) => Ok(()),
        _ => Err(format!(
            "invalid {setting} {:?}: expected http://host:port or https://host:port",
            crate::redact::url(url)
        )),
    }
}

fn ratio(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(r) if (0.0..=1.0).contains(&r) => Ok(r),
        _ => Err(format!("{s:?} is not a ratio between 0.0 and 1.0")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        trace: TraceArgs,
    }

    fn parse(args: &[&str]) -> Result<TraceArgs, clap::Error> {
        Cli::try_parse_from(std::iter::once("x").chain(args.iter().copied())).map(|c| c.trace)
    }

    #[test]
    fn endpoint_gets_the_traces_path() {
        let a = parse(&["--otlp-endpoint", "http://127.0.0.1:4318/"]).unwrap();
        assert_eq!(
            a.traces_url().unwrap().as_deref(),
            Some("http://127.0.0.1:4318/v1/traces")
        );
        let a = parse(&[
            "--otlp-endpoint",
            "http://a:1",
            "--otlp-traces-endpoint",
            "http://b:2/x",
        ])
        .unwrap();
        assert_eq!(a.traces_url().unwrap().as_deref(), Some("http://b:2/x"));
    }

    #[test]
    fn bad_values_name_the_setting() {
        let a = parse(&["--otlp-endpoint", "localhost:4318"]).unwrap();
        let e = a.traces_url().unwrap_err();
        assert!(
            e.contains("--otlp-endpoint (OTEL_EXPORTER_OTLP_ENDPOINT)"),
            "{e}"
        );
    }

    #[test]
    fn a_query_stays_after_the_path_and_its_values_are_never_shown() {
        let a = parse(&["--otlp-endpoint", "http://u:p@c:4318/base/?api_key=k"]).unwrap();
        let url = a.traces_url().unwrap().unwrap();
        assert_eq!(url, "http://u:p@c:4318/base/v1/traces?api_key=k");
        assert_eq!(
            crate::redact::url(&url),
            "http://***@c:4318/base/v1/traces?api_key=***"
        );
    }

    #[test]
    fn unknown_samplers_are_the_default_not_an_error() {
        for (sampler, arg) in [
            (
                "parentbased_jaeger_remote",
                "endpoint=http://x,pollingIntervalMs=5000",
            ),
            ("xray", ""),
            ("ALWAYS_OFF", "abc"),
            ("traceidratio", "NaN"),
        ] {
            let a = parse(&[
                "--otel-traces-sampler",
                sampler,
                "--otel-traces-sampler-arg",
                arg,
            ])
            .unwrap();
            let _ = a.sampler();
        }
        let a = parse(&["--otel-traces-sampler", "ALWAYS_OFF"]).unwrap();
        assert!(matches!(a.sampler(), Sampler::AlwaysOff));
    }
}

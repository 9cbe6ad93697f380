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

    /// Which traces are recorded. The parent-based samplers follow the
    /// sampled flag of the incoming (or stored) traceparent.
    #[arg(
        long = "otel-traces-sampler",
        env = "OTEL_TRACES_SAMPLER",
        value_enum,
        default_value_t = TracesSampler::ParentBasedAlwaysOn,
        help_heading = "Traces (OpenTelemetry)"
    )]
    pub sampler: TracesSampler,

    /// The ratio of the `*traceidratio` samplers, 0.0 to 1.0.
    #[arg(
        long = "otel-traces-sampler-arg",
        env = "OTEL_TRACES_SAMPLER_ARG",
        value_name = "RATIO",
        default_value_t = 1.0,
        value_parser = ratio,
        help_heading = "Traces (OpenTelemetry)"
    )]
    pub sampler_arg: f64,

    /// Spans held for export at most; a span ending while the queue is full
    /// (the collector slow or down) is dropped and counted, never waited
    /// for. About 1 KiB each.
    #[arg(
        long = "otlp-queue-spans",
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
                format!("{}/v1/traces", base.trim().trim_end_matches('/'))
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

    /// The sampler the flags describe.
    pub fn sampler(&self) -> Sampler {
        let ratio = self.sampler_arg;
        match self.sampler {
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
        .map_err(|e| format!("invalid {setting} {url:?}: {e}"))?;
    match (parsed.scheme_str(), parsed.host()) {
        (Some("http" | "https"), Some(_)) => Ok(()),
        _ => Err(format!(
            "invalid {setting} {url:?}: expected http://host:port or https://host:port"
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
        assert!(parse(&["--otel-traces-sampler-arg", "1.5"]).is_err());
        assert!(parse(&["--otel-traces-sampler", "sometimes"]).is_err());
    }
}

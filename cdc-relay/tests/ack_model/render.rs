//! How a path of the model is shown: each state in one line, the WAL in
//! words.

use std::fmt;

use crate::model::{AckModel, Action, Item, State, end_of};
use crate::rules::Rule;

pub(crate) struct Summary<'a, R: Rule>(pub(crate) &'a State<R>);

impl<R: Rule> fmt::Display for Summary<'_, R> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = self.0;
        let bits = |m: u8| -> Vec<u8> { (0..8).filter(|e| m & (1 << e) != 0).collect() };
        write!(
            f,
            "slot={} relay.confirmed={} sent={} delivered={:?}/{:?} parked={:?}/{:?} pending(event,endpoint)={:?} sinks={:?} crashes={}",
            s.slot.as_u64(),
            s.tracker.confirmed().as_u64(),
            s.sent.as_u64(),
            bits(s.delivered[0]),
            bits(s.delivered[1]),
            bits(s.parked[0]),
            bits(s.parked[1]),
            s.pending
                .iter()
                .map(|&(e, ep, _)| (e, ep))
                .collect::<Vec<_>>(),
            s.sink_up,
            s.crashes,
        )
    }
}

pub(crate) fn describe_wal(items: &[Item]) -> String {
    let mut out = Vec::new();
    let mut event = 0u8;
    for (i, it) in items.iter().enumerate() {
        match it {
            Item::Tx(n) => {
                let ids: Vec<u8> = (event..event + n).collect();
                event += n;
                out.push(format!(
                    "item {i}: tx events {ids:?} end {}",
                    end_of(i).as_u64()
                ));
            }
            Item::Gap => out.push(format!(
                "item {i}: unpublished WAL up to {}",
                end_of(i).as_u64()
            )),
        }
    }
    out.join("; ")
}

pub(crate) fn render<R: Rule>(
    model: &AckModel<R>,
    steps: Vec<(State<R>, Option<Action>)>,
) -> String {
    let mut out = format!(
        "  WAL: {}\n  start: {}\n",
        describe_wal(model.items(&steps[0].0)),
        Summary(&steps[0].0)
    );
    for w in steps.windows(2) {
        let action = w[0].1.expect("every step but the last has an action");
        out += &format!("  {action:?} -> {}\n", Summary(&w[1].0));
    }
    out
}

//! Admission: which waiting requests the next step prefills. A policy of its own, apart from the
//! step's mechanics, so a new one (a token budget per step, priorities) is written here and
//! tested without a model or a pool.

/// The admission policy of an [`Engine`](crate::engine::Engine): first come, first served, up
/// to a budget of prompt tokens per step.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Scheduler {
    /// Prompt tokens one step may prefill; `None` (the default) admits every waiting request.
    /// The first waiting request is always admitted, however long, so nothing starves.
    pub max_prefill_tokens: Option<usize>,
    /// Tokens one step may compute, decodes (one each) and prefill chunks together: a prompt
    /// longer than what the step's decodes leave is prefilled in whole blocks over several
    /// steps (chunked prefill), so running sequences keep their pace beside a long prompt.
    /// `None` (the default): every admitted prompt is prefilled whole in its step.
    pub max_step_tokens: Option<usize>,
}

impl Scheduler {
    /// How many of the waiting requests, in queue order with these prompt lengths, the next step
    /// prefills.
    #[must_use]
    pub fn admit(&self, waiting: impl IntoIterator<Item = usize>) -> usize {
        let Some(budget) = self.max_prefill_tokens else {
            return waiting.into_iter().count();
        };
        let mut used = 0usize;
        let mut n = 0;
        for len in waiting {
            if n > 0 && used.saturating_add(len) > budget {
                break;
            }
            used = used.saturating_add(len);
            n += 1;
        }
        n
    }
}

#[cfg(test)]
mod tests {
    use super::Scheduler;

    #[test]
    fn admission_cases() {
        let all = Scheduler::default();
        let budget = Scheduler {
            max_prefill_tokens: Some(100),
            ..Scheduler::default()
        };
        let cases: [(Scheduler, &[usize], usize); 6] = [
            (all, &[], 0),
            (all, &[5000, 1, 1], 3),
            (budget, &[], 0),
            (budget, &[40, 60, 1], 2),
            // The head of the queue goes in even when it alone exceeds the budget.
            (budget, &[500, 1], 1),
            (budget, &[100, 1], 1),
        ];
        for (s, waiting, want) in cases {
            assert_eq!(s.admit(waiting.iter().copied()), want, "{s:?} {waiting:?}");
        }
    }
}

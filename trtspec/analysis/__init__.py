"""From records to decisions: statistics, record schema and extraction, the verdict and its gates,
goodput, the cost model, crossover, and the serving policy and schedules derived from them."""

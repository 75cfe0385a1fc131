package llmbench

import "math"

// quantileTable is an empirical distribution given by its quantiles: values[i] is the
// quantile at probs[i]. Sampling interpolates linearly between neighbouring quantiles.
type quantileTable struct {
	probs  []float64
	values []float64
}

// sample returns the value at probability u in [0, 1), at least 1.
func (q quantileTable) sample(u float64) int {
	for i := 1; i < len(q.probs); i++ {
		if u <= q.probs[i] {
			lo, hi := q.probs[i-1], q.probs[i]
			frac := (u - lo) / (hi - lo)
			v := q.values[i-1] + frac*(q.values[i]-q.values[i-1])
			return max(1, int(math.Round(v)))
		}
	}
	return max(1, int(q.values[len(q.values)-1]))
}

// azureQuantiles are the probabilities of the tables below: every 2.5% plus the tail.
var azureQuantiles = []float64{
	0, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.175, 0.2, 0.225, 0.25, 0.275, 0.3, 0.325, 0.35,
	0.375, 0.4, 0.425, 0.45, 0.475, 0.5, 0.525, 0.55, 0.575, 0.6, 0.625, 0.65, 0.675, 0.7, 0.725,
	0.75, 0.775, 0.8, 0.825, 0.85, 0.875, 0.9, 0.925, 0.95, 0.975, 0.99, 0.995, 0.999, 1,
}

// azureConv holds the marginal distributions of ContextTokens and GeneratedTokens in the Azure
// LLM inference trace 2023, conversation (AzureLLMInferenceTrace_conv.csv, 19,366 requests,
// Microsoft Azure, CC-BY-4.0), measured on the file: input mean 1,155, output mean 211. Input
// and output are sampled independently; the trace's correlation between them is not kept.
var azureConv = struct{ input, output quantileTable }{
	input: quantileTable{probs: azureQuantiles, values: []float64{
		2, 120, 181, 200, 207, 235, 372, 379, 387, 393, 396, 400, 403, 407, 414, 428, 703, 922,
		984, 1005, 1020, 1034, 1045, 1058, 1071, 1083, 1097, 1112, 1130, 1153, 1189, 1277, 1315,
		1434, 1876, 2309, 2735, 4075, 4083, 4092, 4142, 4831, 6212, 14050,
	}},
	output: quantileTable{probs: azureQuantiles, values: []float64{
		7, 28, 41, 48, 54, 60, 67, 72, 77, 82, 85, 88, 91, 93, 96, 99, 103, 108, 113, 120, 129,
		139, 151, 162, 177, 195, 217, 373, 384, 391, 395, 396, 400, 406, 411, 416, 424, 430, 451,
		522, 601, 643, 954, 1000,
	}},
}

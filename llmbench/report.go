package llmbench

import (
	"encoding/json"
	"fmt"
	"html"
	"io"
	"math"
	"strings"
	"text/tabwriter"
)

// WriteTable writes one line per policy: hit rate, cold requests (served with nothing from
// the prefix cache), TTFT p50/p90/p99, E2E p50/p99 (seconds,
// over every request: "inf" where shed and failed requests reach the percentile), throughput
// (output tokens/s), goodput (served requests/s), load spread (max/mean requests and tokens
// per replica), shed and errored requests.
func WriteTable(w io.Writer, sums []Summary) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintln(tw, "policy\thit rate\tcold\tTTFT p50\tp90\tp99\tE2E p50\tp99\ttok/s\tgoodput req/s\tmax/mean req\ttok\tshed\terrors\t")
	for _, s := range sums {
		fmt.Fprintf(tw, "%s\t%s\t%d\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\t%d\t%d\t\n",
			s.Policy, percent(s.HitRate), s.Cold,
			seconds(s.TTFTP50), seconds(s.TTFTP90), seconds(s.TTFTP99),
			seconds(s.E2EP50), seconds(s.E2EP99),
			number(s.Throughput, 0), number(s.Goodput, 2), number(s.MaxMeanLoad, 2), number(s.MaxMeanTokens, 2),
			s.Shed, s.Errors)
	}
	return tw.Flush()
}

func percent(v float64) string {
	if math.IsNaN(v) {
		return "-"
	}
	return fmt.Sprintf("%.1f%%", 100*v)
}

func seconds(v float64) string {
	switch {
	case math.IsNaN(v):
		return "-"
	case math.IsInf(v, 1):
		return "inf"
	case v < 1:
		return fmt.Sprintf("%.3fs", v)
	case v < 100:
		return fmt.Sprintf("%.2fs", v)
	}
	return fmt.Sprintf("%.0fs", v)
}

func number(v float64, decimals int) string {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return "-"
	}
	return fmt.Sprintf("%.*f", decimals, v)
}

// jsonFloat writes what JSON numbers cannot hold as follows: NaN (no value: an empty
// replay's percentiles) as null, +Inf (a percentile reached by shed or failed requests) as
// the string "+Inf", -Inf as "-Inf".
type jsonFloat float64

func (f jsonFloat) MarshalJSON() ([]byte, error) {
	v := float64(f)
	switch {
	case math.IsNaN(v):
		return []byte("null"), nil
	case math.IsInf(v, 1):
		return []byte(`"+Inf"`), nil
	case math.IsInf(v, -1):
		return []byte(`"-Inf"`), nil
	}
	return json.Marshal(v)
}

// policyJSON is one policy's entry in the --json report.
type policyJSON struct {
	Policy        string    `json:"policy"`
	HitRate       jsonFloat `json:"hit_rate"`
	TTFTP50       jsonFloat `json:"ttft_p50_s"`
	TTFTP90       jsonFloat `json:"ttft_p90_s"`
	TTFTP99       jsonFloat `json:"ttft_p99_s"`
	TTFTMean      jsonFloat `json:"ttft_mean_s"`
	E2EP50        jsonFloat `json:"e2e_p50_s"`
	E2EP99        jsonFloat `json:"e2e_p99_s"`
	Throughput    jsonFloat `json:"throughput_tok_s"`
	Goodput       jsonFloat `json:"goodput_req_s"`
	MaxMeanLoad   jsonFloat `json:"max_mean_load"`
	MaxMeanTokens jsonFloat `json:"max_mean_tokens"`
	Cold          int       `json:"cold"`
	Requests      int       `json:"requests"`
	Completed     int       `json:"completed"`
	Shed          int       `json:"shed"`
	Errors        int       `json:"errors"`
	WallSeconds   jsonFloat `json:"wall_s"`
}

// MarshalJSON writes the summary's figures, with null for those that have no value and
// "+Inf" for percentiles that shed or failed requests reach (see [Summary]).
func (s Summary) MarshalJSON() ([]byte, error) {
	return json.Marshal(policyJSON{
		Policy: s.Policy, HitRate: jsonFloat(s.HitRate),
		TTFTP50: jsonFloat(s.TTFTP50), TTFTP90: jsonFloat(s.TTFTP90), TTFTP99: jsonFloat(s.TTFTP99),
		TTFTMean: jsonFloat(s.TTFTMean), E2EP50: jsonFloat(s.E2EP50), E2EP99: jsonFloat(s.E2EP99),
		Throughput: jsonFloat(s.Throughput), Goodput: jsonFloat(s.Goodput), MaxMeanLoad: jsonFloat(s.MaxMeanLoad),
		MaxMeanTokens: jsonFloat(s.MaxMeanTokens), Cold: s.Cold, Requests: s.Requests, Completed: s.Completed,
		Shed: s.Shed, Errors: s.Errors, WallSeconds: jsonFloat(s.WallSeconds),
	})
}

// Report is the --json output: the run's parameters and one summary per
// policy; with several router seeds, every seed's summary per policy and
// the default strategy's goal verdicts.
type Report struct {
	Parameters map[string]any `json:"parameters"`
	Policies   []Summary      `json:"policies,omitempty"`
	SeedRuns   []SeedRuns     `json:"seed_runs,omitempty"`
	Goals      []GoalCheck    `json:"goals,omitempty"`
}

// WriteJSON writes the report as indented JSON.
func WriteJSON(w io.Writer, rep Report) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(rep)
}

// SVG layout, in pixels.
const (
	svgWidth     = 900
	svgHeight    = 520
	plotLeft     = 70
	plotTop      = 50
	plotWidth    = 560
	plotHeight   = 400
	legendLeft   = plotLeft + plotWidth + 30
	maxCDFPoints = 400
)

// svgColors is the Tableau 10 palette, distinct enough for ten lines.
var svgColors = []string{
	"#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f",
	"#edc948", "#b07aa1", "#ff9da7", "#9c755f", "#bab0ac",
}

// WriteSVG draws the TTFT distribution of every policy as a CDF on a logarithmic time axis:
// the y value at time t is the fraction of all requests (shed and failed ones included, which
// never arrive) whose first token came within t.
func WriteSVG(w io.Writer, title string, sums []Summary) error {
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, s := range sums {
		if len(s.TTFTs) > 0 {
			lo = min(lo, s.TTFTs[0])
			hi = max(hi, s.TTFTs[len(s.TTFTs)-1])
		}
	}
	if math.IsInf(lo, 1) {
		lo, hi = 0.01, 1
	}
	decLo := math.Floor(math.Log10(max(lo, 1e-4)))
	decHi := math.Ceil(math.Log10(max(hi, 1e-4)))
	if decHi <= decLo {
		decHi = decLo + 1
	}
	x := func(sec float64) float64 {
		l := math.Log10(max(sec, 1e-4))
		return plotLeft + (l-decLo)/(decHi-decLo)*plotWidth
	}
	y := func(frac float64) float64 { return plotTop + (1-frac)*plotHeight }

	var b strings.Builder
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" viewBox="0 0 %d %d" font-family="sans-serif" font-size="12">`+"\n",
		svgWidth, svgHeight, svgWidth, svgHeight)
	fmt.Fprintf(&b, `<rect width="100%%" height="100%%" fill="white"/>`+"\n")
	fmt.Fprintf(&b, `<text x="%d" y="28" font-size="15" font-weight="bold">%s</text>`+"\n", plotLeft, html.EscapeString(title))
	// Grid and axis labels.
	for d := decLo; d <= decHi; d++ {
		px := x(math.Pow(10, d))
		fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#ddd"/>`+"\n", px, plotTop, px, plotTop+plotHeight)
		fmt.Fprintf(&b, `<text x="%.1f" y="%d" text-anchor="middle">%s</text>`+"\n", px, plotTop+plotHeight+18, decadeLabel(d))
		if d < decHi {
			for m := 2.0; m < 10; m++ {
				pm := x(m * math.Pow(10, d))
				fmt.Fprintf(&b, `<line x1="%.1f" y1="%d" x2="%.1f" y2="%d" stroke="#f2f2f2"/>`+"\n", pm, plotTop, pm, plotTop+plotHeight)
			}
		}
	}
	for _, f := range []float64{0, 0.25, 0.5, 0.75, 0.9, 1} {
		py := y(f)
		fmt.Fprintf(&b, `<line x1="%d" y1="%.1f" x2="%d" y2="%.1f" stroke="#ddd"/>`+"\n", plotLeft, py, plotLeft+plotWidth, py)
		fmt.Fprintf(&b, `<text x="%d" y="%.1f" text-anchor="end">%g%%</text>`+"\n", plotLeft-6, py+4, 100*f)
	}
	fmt.Fprintf(&b, `<rect x="%d" y="%d" width="%d" height="%d" fill="none" stroke="#333"/>`+"\n", plotLeft, plotTop, plotWidth, plotHeight)
	fmt.Fprintf(&b, `<text x="%d" y="%d" text-anchor="middle">time to first token (seconds, log scale)</text>`+"\n",
		plotLeft+plotWidth/2, plotTop+plotHeight+40)
	fmt.Fprintf(&b, `<text transform="translate(18 %d) rotate(-90)" text-anchor="middle">requests with first token (cumulative)</text>`+"\n",
		plotTop+plotHeight/2)
	// One CDF line per policy.
	for i, s := range sums {
		color := svgColors[i%len(svgColors)]
		n := len(s.TTFTs)
		total := max(s.Requests, n)
		if n > 0 {
			var pts strings.Builder
			step := max(1, n/maxCDFPoints)
			for k := 0; k < n; k += step {
				fmt.Fprintf(&pts, "%.1f,%.1f ", x(s.TTFTs[k]), y(float64(k+1)/float64(total)))
			}
			fmt.Fprintf(&pts, "%.1f,%.1f", x(s.TTFTs[n-1]), y(float64(n)/float64(total)))
			fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="2" points="%s"/>`+"\n", color, pts.String())
		}
		ly := plotTop + 10 + 20*i
		fmt.Fprintf(&b, `<line x1="%d" y1="%d" x2="%d" y2="%d" stroke="%s" stroke-width="3"/>`+"\n", legendLeft, ly, legendLeft+24, ly, color)
		fmt.Fprintf(&b, `<text x="%d" y="%d">%s (p50 %s)</text>`+"\n", legendLeft+30, ly+4, html.EscapeString(s.Policy), seconds(s.TTFTP50))
	}
	b.WriteString("</svg>\n")
	_, err := io.WriteString(w, b.String())
	return err
}

func decadeLabel(d float64) string {
	v := math.Pow(10, d)
	switch {
	case v < 1:
		return fmt.Sprintf("%gms", v*1000)
	default:
		return fmt.Sprintf("%gs", v)
	}
}

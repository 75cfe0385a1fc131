// Command kvsim runs one simulated vLLM-compatible inference engine, or a fleet of them on
// consecutive ports.
//
//	kvsim --listen 127.0.0.1:9001 --replicas 4
//
// serves replica-0 on port 9001 through replica-3 on port 9004. See kvsim --help.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"go.uber.org/zap"

	"github.com/llmaffinity/caddy-llm-affinity/kvsim"
)

func main() {
	if err := run(os.Args[1:]); err != nil {
		fmt.Fprintln(os.Stderr, "kvsim:", err)
		os.Exit(1)
	}
}

// settings are the command's flags.
type settings struct {
	engine     kvsim.Config
	faults     kvsim.Faults
	listen     string
	replicas   int
	namePrefix string
	speed      float64
	verbose    bool
}

// newFlags returns the command's flag set, bound to the settings it returns. The engine and
// fault flags come from kvsim's option tables, named after the fields' JSON names with dashes
// (fault ones prefixed fault-), and an engine flag defaults to its field's default in
// kvsim.Config.WithDefaults.
func newFlags(output io.Writer) (*flag.FlagSet, *settings) {
	fs := flag.NewFlagSet("kvsim", flag.ContinueOnError)
	fs.SetOutput(output)
	fs.Usage = func() {
		fmt.Fprintf(fs.Output(), "Usage: kvsim [flags]\n\n"+
			"Runs simulated vLLM-compatible inference engines (OpenAI API, /tokenize, /detokenize,\n"+
			"/health, /ping, /metrics, /kvsim/state, /kvsim/faults). With --replicas N, replica i listens on the port of\n"+
			"--listen plus i and is named <--name-prefix>i.\n\nFlags:\n")
		fs.PrintDefaults()
	}
	s := &settings{engine: kvsim.Config{}.WithDefaults()}
	fs.StringVar(&s.listen, "listen", "127.0.0.1:9001", "`address` of the first replica; further replicas use the following ports")
	fs.IntVar(&s.replicas, "replicas", 1, "number of replicas to run")
	fs.StringVar(&s.namePrefix, "name-prefix", "replica-", "replica names are this prefix followed by the replica index (sent in the X-Kvsim-Replica header)")
	fs.Float64Var(&s.speed, "speed", 1, "simulated time runs this many times faster than wall clock")
	fs.BoolVar(&s.verbose, "verbose", false, "log every request (never prompt text)")
	for _, o := range s.engine.Options() {
		addFlag(fs, "", o)
	}
	for _, o := range s.faults.Options() {
		addFlag(fs, "fault-", o)
	}
	return fs, s
}

// parseFlags parses the command line.
func parseFlags(args []string, output io.Writer) (*settings, error) {
	fs, s := newFlags(output)
	if err := fs.Parse(args); err != nil {
		return nil, err
	}
	if s.replicas < 1 {
		return nil, errors.New("--replicas must be at least 1")
	}
	return s, nil
}

// addFlag defines the flag of option o, bound to its field, with the field's current value
// as the default.
func addFlag(fs *flag.FlagSet, prefix string, o kvsim.Option) {
	name := prefix + strings.ReplaceAll(o.Name, "_", "-")
	switch p := o.Field.(type) {
	case *string:
		fs.StringVar(p, name, *p, o.Usage)
	case *int:
		fs.IntVar(p, name, *p, o.Usage)
	case *bool:
		fs.BoolVar(p, name, *p, o.Usage)
	case *float64:
		fs.Float64Var(p, name, *p, o.Usage)
	case *time.Duration:
		fs.DurationVar(p, name, *p, o.Usage)
	case *[]string:
		fs.Func(name, o.Usage+", as a comma-separated `list` (repeatable)", func(v string) error {
			for _, item := range strings.Split(v, ",") {
				if item = strings.TrimSpace(item); item != "" {
					*p = append(*p, item)
				}
			}
			return nil
		})
	default:
		panic(fmt.Sprintf("kvsim option %s has unsupported type %T", o.Name, o.Field))
	}
}

func run(args []string) error {
	s, err := parseFlags(args, os.Stderr)
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return err
	}
	host, portText, err := net.SplitHostPort(s.listen)
	if err != nil {
		return fmt.Errorf("--listen: %w", err)
	}
	port, err := strconv.Atoi(portText)
	if err != nil {
		return fmt.Errorf("--listen port: %w", err)
	}
	logger := zap.NewNop()
	if s.verbose {
		if logger, err = zap.NewDevelopment(); err != nil {
			return err
		}
	}

	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	errc := make(chan error, s.replicas)
	var servers []*http.Server
	for i := range s.replicas {
		name := s.namePrefix + strconv.Itoa(i)
		sim, err := kvsim.NewServer(kvsim.ServerConfig{Name: name, Engine: s.engine, Speed: s.speed, Faults: s.faults, Logger: logger.Named(name)})
		if err != nil {
			return err
		}
		defer sim.Close()
		addr := net.JoinHostPort(host, strconv.Itoa(port+i))
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			return err
		}
		srv := &http.Server{Handler: sim, ReadHeaderTimeout: 10 * time.Second}
		servers = append(servers, srv)
		fmt.Fprintf(os.Stderr, "kvsim: %s serving %s on http://%s\n", name, s.engine.Model, ln.Addr())
		go func() { errc <- srv.Serve(ln) }()
	}
	select {
	case <-ctx.Done():
	case err := <-errc:
		return err
	}
	shutdownCtx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	for _, srv := range servers {
		_ = srv.Shutdown(shutdownCtx)
	}
	return nil
}

package caddyllm

import (
	"bytes"
	"encoding/binary"
	"fmt"
	"math/bits"
	"strings"
	"unicode"
	"unicode/utf16"
	"unicode/utf8"
)

// maxDepth is the deepest nesting of arrays and objects a body may have,
// encoding/json's limit.
const maxDepth = 10000

// scanner reads one JSON text in a single forward pass, validating it as
// encoding/json does (strings are not checked for valid UTF-8; control
// characters must be escaped). Values are returned as byte ranges of buf,
// never copied. The first syntax error stops it.
type scanner struct {
	buf   []byte
	pos   int
	depth int
	err   error
	// inObject has bit d set when the container at depth d is an object
	// (for skip, which walks values it does not look into). Its length
	// bounds the depth: maxDepth/64+1 words allow what encoding/json
	// allows.
	inObject []uint64
	// escapeExtra counts, over every string read, the bytes its escapes
	// take beyond the UTF-8 they stand for (1 for \n, 3 for \u4e2d): a
	// span's text is its bytes less what the count rose by while it was
	// read. Engines count the text: a client that escapes every
	// non-ASCII character (Python's json.dumps does by default) sends
	// twice its bytes.
	escapeExtra int
}

// syntaxError is a malformed body, at a byte offset.
type syntaxError struct {
	off int
	msg string
}

func (e *syntaxError) Error() string {
	return fmt.Sprintf("invalid JSON body at byte %d: %s", e.off, e.msg)
}

// fail records the first syntax error and stops the scan.
func (s *scanner) fail(format string, args ...any) bool {
	if s.err == nil {
		s.err = &syntaxError{off: s.pos, msg: fmt.Sprintf(format, args...)}
	}
	s.pos = len(s.buf)
	return false
}

// unexpected fails on the byte at pos (or the end of input).
func (s *scanner) unexpected(context string) bool {
	if s.pos >= len(s.buf) {
		return s.fail("unexpected end of JSON input")
	}
	return s.fail("invalid character (%s) %s", describeChar(s.buf[s.pos]), context)
}

// describeChar names c for an error message without quoting the body
// (encoding/json's errors quote it): JSON's own punctuation as itself,
// anything else by its kind.
func describeChar(c byte) string {
	switch {
	case strings.IndexByte(`{}[]:,"`, c) >= 0:
		return "'" + string(c) + "'"
	case c < 0x20 || c == 0x7f:
		return "a control character"
	case c >= 0x80:
		return "a byte outside ASCII"
	case 'a' <= c && c <= 'z' || 'A' <= c && c <= 'Z':
		return "a letter"
	case '0' <= c && c <= '9':
		return "a digit"
	}
	return "a symbol"
}

// ws skips whitespace and returns the next byte, 0 at the end.
func (s *scanner) ws() byte {
	for s.pos < len(s.buf) {
		c := s.buf[s.pos]
		if c > ' ' {
			return c // most often: no whitespace at all
		}
		switch c {
		case ' ', '\t', '\n', '\r':
			s.pos++
		default:
			return c
		}
	}
	return 0
}

// push enters a container.
func (s *scanner) push(object bool) bool {
	s.depth++
	if s.depth > maxDepth || s.depth/64 >= len(s.inObject) {
		return s.fail("exceeded max depth")
	}
	w, bit := s.depth/64, uint64(1)<<(s.depth%64)
	if object {
		s.inObject[w] |= bit
	} else {
		s.inObject[w] &^= bit
	}
	return true
}

// SWAR constants: one in every byte, and every byte's high bit.
const (
	lsb = 0x0101010101010101
	msb = 0x8080808080808080
)

// special has the high bit set in the first byte of w that is a quote, a
// backslash or a control character (bytes after it may be set too). A
// quote is the one byte other than the control characters that is below
// 0x21 once bit 1 is flipped, so two tests cover the three.
func special(w uint64) uint64 {
	q := w ^ (lsb * 0x02)
	b := w ^ (lsb * '\\')
	return ((q-lsb*0x21)&^q | (b-lsb)&^b) & msb
}

// str reads the string whose opening quote is at pos and returns the
// range of its contents (still escaped) and whether it has escapes.
// Strings are where the bytes of a request are. Runs without escapes are
// found with bytes.IndexByte (vectorised) and checked for control
// characters eight bytes at a time; where escapes come close together,
// strMarks takes over.
func (s *scanner) str() (start, end int, escaped, ok bool) {
	buf := s.buf
	start = s.pos + 1
	if start+16 <= len(buf) {
		// Short strings (keys, roles) end in their first sixteen bytes.
		w := buf[start : start+16 : start+16]
		if m0 := special(binary.LittleEndian.Uint64(w[:8])); m0 != 0 {
			if p := start + bits.TrailingZeros64(m0)>>3; buf[p] == '"' {
				s.pos = p + 1
				return start, p, false, true
			}
		} else if m1 := special(binary.LittleEndian.Uint64(w[8:])); m1 != 0 {
			if p := start + 8 + bits.TrailingZeros64(m1)>>3; buf[p] == '"' {
				s.pos = p + 1
				return start, p, false, true
			}
		}
	}
	i := start // the first byte not yet read
	q := -1    // the next quote at or after i, once known
	for {
		if q < i {
			q = bytes.IndexByte(buf[i:], '"')
			if q < 0 {
				return s.strMarks(start, i, escaped)
			}
			q += i
		}
		run := buf[i:q]
		bs := bytes.IndexByte(run, '\\')
		if bs >= 0 {
			run = run[:bs]
		}
		if hasControl(run) {
			return s.strMarks(start, i, escaped)
		}
		if bs < 0 {
			s.pos = q + 1
			return start, q, escaped, true
		}
		escaped = true
		p := i + bs
		if p+1 < len(buf) && simpleEscape[buf[p+1]] {
			i = p + 2
			s.escapeExtra++
		} else if i, ok = s.escape(p); !ok {
			return 0, 0, false, false
		}
		if bs < 16 {
			// Escapes close together: a call per escape costs more than
			// looking at every byte.
			return s.strMarks(start, i, escaped)
		}
	}
}

// stringAt reads the string whose contents begin at start of buf (its
// opening quote just before) as str does: where its contents end, and
// whether they have escapes. A streamed token is most often a few plain
// bytes, found in the first eight without a scanner.
func stringAt(buf []byte, start int) (end int, escaped, ok bool) {
	if end = plainEnd(buf, start); end >= 0 {
		return end, false, true
	}
	s := scanner{buf: buf, pos: start - 1}
	_, end, escaped, ok = s.str()
	return end, escaped, ok
}

// plainEnd returns where the string whose contents begin at start of buf
// ends when it is plain (no escape, no control byte) and shorter than
// eight bytes, its closing quote then the first quote, backslash or
// control byte of the eight from start; -1 otherwise, or when buf has
// fewer than eight bytes from start.
func plainEnd(buf []byte, start int) int {
	if start+8 <= len(buf) {
		if m := special(binary.LittleEndian.Uint64(buf[start:])); m != 0 {
			if end := start + bits.TrailingZeros64(m)>>3; buf[end] == '"' {
				return end
			}
		}
	}
	return -1
}

// hasControl reports whether p has a byte below 0x20.
func hasControl(p []byte) bool {
	var acc uint64
	// Sixty-four bytes a round: the one slice expression lets the compiler
	// drop the bounds checks of the eight loads. The loads are inside the
	// expression: each on a line of its own would leave a NOP in the loop
	// to mark where the compiler inlined it.
	for len(p) >= 64 {
		w := p[:64:64]
		acc |= below20(binary.LittleEndian.Uint64(w[0:])) | below20(binary.LittleEndian.Uint64(w[8:])) |
			below20(binary.LittleEndian.Uint64(w[16:])) | below20(binary.LittleEndian.Uint64(w[24:])) |
			below20(binary.LittleEndian.Uint64(w[32:])) | below20(binary.LittleEndian.Uint64(w[40:])) |
			below20(binary.LittleEndian.Uint64(w[48:])) | below20(binary.LittleEndian.Uint64(w[56:]))
		p = p[64:]
	}
	for len(p) >= 8 {
		acc |= below20(binary.LittleEndian.Uint64(p))
		p = p[8:]
	}
	for _, c := range p {
		if c < 0x20 {
			return true
		}
	}
	return acc&msb != 0
}

// below20 has the high bit set in each byte of w below 0x20 (and maybe
// in a byte after one).
func below20(w uint64) uint64 { return (w - lsb*0x20) &^ w }

// strMarks reads the rest of the string from i, whose contents began at
// start: special marks the bytes to look at in each sixteen.
func (s *scanner) strMarks(start, i int, escaped bool) (int, int, bool, bool) {
	buf := s.buf
	var ok bool
	j := i // the next word to look at
	for ; j+16 <= len(buf); j += 16 {
		w := buf[j : j+16 : j+16]
		m0 := special(binary.LittleEndian.Uint64(w[:8]))
		m1 := special(binary.LittleEndian.Uint64(w[8:]))
		if m0|m1 == 0 {
			continue
		}
		for half, m := range [2]uint64{m0, m1} {
			for ; m != 0; m &= m - 1 {
				p := j + 8*half + bits.TrailingZeros64(m)>>3
				if p < i {
					continue // inside an escape already read
				}
				switch c := buf[p]; {
				case c == '"':
					s.pos = p + 1
					return start, p, escaped, true
				case c == '\\':
					escaped = true
					if p+1 < len(buf) && simpleEscape[buf[p+1]] {
						i = p + 2
						s.escapeExtra++
					} else if i, ok = s.escape(p); !ok {
						return 0, 0, false, false
					}
				case c < 0x20:
					s.pos = p
					return 0, 0, false, s.unexpected("in string literal")
				}
				// Otherwise a false positive of special, after a match.
			}
		}
	}
	for i = max(i, j); i < len(buf); {
		switch c := buf[i]; {
		case c == '"':
			s.pos = i + 1
			return start, i, escaped, true
		case c == '\\':
			escaped = true
			if i, ok = s.escape(i); !ok {
				return 0, 0, false, false
			}
		case c < 0x20:
			s.pos = i
			return 0, 0, false, s.unexpected("in string literal")
		default:
			i++
		}
	}
	s.pos = i
	return 0, 0, false, s.fail("unexpected end of JSON input")
}

// simpleEscape marks the bytes that follow a backslash in a two-byte
// escape.
var simpleEscape = [256]bool{'"': true, '\\': true, '/': true, 'b': true, 'f': true, 'n': true, 'r': true, 't': true}

// escape checks the escape sequence whose backslash is at p, counts it in
// escapeExtra and returns the offset after it.
func (s *scanner) escape(p int) (int, bool) {
	buf := s.buf
	if p+1 >= len(buf) {
		s.pos = len(buf)
		return 0, s.fail("unexpected end of JSON input")
	}
	switch buf[p+1] {
	case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
		s.escapeExtra++
		return p + 2, true
	case 'u':
		for k := p + 2; k < p+6; k++ {
			if k >= len(buf) {
				s.pos = k
				return 0, s.fail("unexpected end of JSON input")
			}
			if !isHex(buf[k]) {
				s.pos = k
				return 0, s.unexpected("in \\u hexadecimal character escape")
			}
		}
		n := utf8.RuneLen(hex4(buf[p+2:]))
		if n < 0 {
			n = 2 // half of a surrogate pair's four bytes
		}
		s.escapeExtra += 6 - n
		return p + 6, true
	}
	s.pos = p + 1
	return 0, s.unexpected("in string escape code")
}

func isHex(c byte) bool {
	return '0' <= c && c <= '9' || 'a' <= c && c <= 'f' || 'A' <= c && c <= 'F'
}

// number reads the number at pos and returns its range.
func (s *scanner) number() (start, end int, ok bool) {
	buf := s.buf
	start = s.pos
	i := start
	if i < len(buf) && buf[i] == '-' {
		i++
	}
	switch {
	case i < len(buf) && buf[i] == '0':
		i++
	case i < len(buf) && '1' <= buf[i] && buf[i] <= '9':
		for i++; i < len(buf) && '0' <= buf[i] && buf[i] <= '9'; i++ {
		}
	default:
		s.pos = i
		return 0, 0, s.unexpected("in numeric literal")
	}
	if i < len(buf) && buf[i] == '.' {
		i++
		if i >= len(buf) || buf[i] < '0' || buf[i] > '9' {
			s.pos = i
			return 0, 0, s.unexpected("after decimal point in numeric literal")
		}
		for ; i < len(buf) && '0' <= buf[i] && buf[i] <= '9'; i++ {
		}
	}
	if i < len(buf) && (buf[i] == 'e' || buf[i] == 'E') {
		i++
		if i < len(buf) && (buf[i] == '+' || buf[i] == '-') {
			i++
		}
		if i >= len(buf) || buf[i] < '0' || buf[i] > '9' {
			s.pos = i
			return 0, 0, s.unexpected("in exponent of numeric literal")
		}
		for ; i < len(buf) && '0' <= buf[i] && buf[i] <= '9'; i++ {
		}
	}
	s.pos = i
	return start, i, true
}

// literal reads true, false or null at pos.
func (s *scanner) literal() bool {
	var word string
	switch s.buf[s.pos] {
	case 't':
		word = "true"
	case 'f':
		word = "false"
	default:
		word = "null"
	}
	for i := 1; i < len(word); i++ {
		if s.pos+i >= len(s.buf) {
			s.pos += i
			return s.fail("unexpected end of JSON input")
		}
		if s.buf[s.pos+i] != word[i] {
			s.pos += i
			return s.unexpected("in literal " + word + " (expecting '" + word[i:i+1] + "')")
		}
	}
	s.pos += len(word)
	return true
}

// scalar reads the string, number or literal at pos.
func (s *scanner) scalar(c byte) bool {
	switch {
	case c == '"':
		_, _, _, ok := s.str()
		return ok
	case c == 't' || c == 'f' || c == 'n':
		return s.literal()
	case c == '-' || '0' <= c && c <= '9':
		_, _, ok := s.number()
		return ok
	}
	return s.unexpected("looking for beginning of value")
}

// skip reads the value at pos (after whitespace), whatever it is, and
// returns its range. Nested values are walked without recursion.
func (s *scanner) skip() (start, end int, ok bool) {
	base := s.depth
	c := s.ws()
	start = s.pos
	for {
		// A value starts at pos.
		switch c {
		case '{':
			s.pos++
			if !s.push(true) {
				return 0, 0, false
			}
			if c = s.ws(); c != '}' {
				if !s.colonAfterKey() {
					return 0, 0, false
				}
				c = s.ws()
				continue
			}
			s.pos++
			s.depth--
		case '[':
			s.pos++
			if !s.push(false) {
				return 0, 0, false
			}
			if c = s.ws(); c != ']' {
				continue
			}
			s.pos++
			s.depth--
		default:
			if !s.scalar(c) {
				return 0, 0, false
			}
		}
		// A value ended: close containers until another value follows.
		for {
			if s.depth == base {
				return start, s.pos, true
			}
			object := s.inObject[s.depth/64]&(1<<(s.depth%64)) != 0
			c = s.ws()
			switch {
			case c == ',':
				s.pos++
				if object {
					s.ws()
					if !s.colonAfterKey() {
						return 0, 0, false
					}
				}
				c = s.ws()
			case object && c == '}' || !object && c == ']':
				s.pos++
				s.depth--
				continue
			case object:
				return 0, 0, s.unexpected("after object key:value pair")
			default:
				return 0, 0, s.unexpected("after array element")
			}
			break
		}
	}
}

// open reads the '{' of an object at pos.
func (s *scanner) open() bool {
	if s.ws() != '{' {
		return false
	}
	s.pos++
	return s.push(true)
}

// member reads the next key of the object being read, decoded into buf,
// and its colon; it returns false at the object's end (read) or on an
// error (s.err set).
func (s *scanner) member(first bool, buf []byte) ([]byte, bool) {
	switch c := s.ws(); {
	case c == '}':
		s.pos++
		s.depth--
		return nil, false
	case first:
	case c == ',':
		s.pos++
		s.ws()
	default:
		s.unexpected("after object key:value pair")
		return nil, false
	}
	// Most keys are plain, shorter than sixteen bytes and followed at
	// once by the colon: their end is the first quote, backslash or
	// control byte in their first two words. Read here, not in key: the
	// call cost more than the read. (plainEnd over two words, written
	// out here: as a call, which a two-word plainEnd no longer inlines,
	// it cost 170 instructions a request and 1,200 a 64-token stream
	// through stringAt.)
	if p := s.pos + 1; p+16 < len(s.buf) && s.buf[s.pos] == '"' {
		w := s.buf[p : p+16 : p+16]
		off, m := 0, special(binary.LittleEndian.Uint64(w[:8]))
		if m == 0 {
			off, m = 8, special(binary.LittleEndian.Uint64(w[8:]))
		}
		if end := p + off + bits.TrailingZeros64(m)>>3; m != 0 && s.buf[end] == '"' && s.buf[end+1] == ':' {
			s.pos = end + 2
			return s.buf[p:end], true
		}
	}
	return s.key(buf)
}

// element reads what comes before the next element of the array being
// read: nothing before the first, a comma before the others. It returns
// false at the array's end (read) or on an error (s.err set).
func (s *scanner) element(first bool) bool {
	switch c := s.ws(); {
	case c == ']':
		s.pos++
		s.depth--
		return false
	case first:
	case c == ',':
		s.pos++
	default:
		s.unexpected("after array element")
		return false
	}
	return true
}

// colonAfterKey reads a key (at pos) and the colon after it.
func (s *scanner) colonAfterKey() bool {
	if s.pos >= len(s.buf) || s.buf[s.pos] != '"' {
		return s.unexpected("looking for beginning of object key string")
	}
	if _, _, _, ok := s.str(); !ok {
		return false
	}
	if s.ws() != ':' {
		return s.unexpected("after object key")
	}
	s.pos++
	return true
}

// key reads an object key and the colon after it, decoded into dst (a
// scratch buffer) when it has escapes: the keys member does not read at
// once (long, escaped, or with space before the colon).
func (s *scanner) key(dst []byte) ([]byte, bool) {
	if s.pos >= len(s.buf) || s.buf[s.pos] != '"' {
		return nil, s.unexpected("looking for beginning of object key string")
	}
	start, end, escaped, ok := s.str()
	if !ok {
		return nil, false
	}
	// Keys are only matched against ASCII names: a key without escapes
	// matches as it is (invalid UTF-8, which decoding would replace with
	// U+FFFD, matches no name either way).
	k := s.buf[start:end]
	if escaped {
		k = decodeString(dst, k, true)
	}
	if s.ws() != ':' {
		return nil, s.unexpected("after object key")
	}
	s.pos++
	return k, true
}

// end checks that nothing but whitespace follows the top-level value.
func (s *scanner) end() bool {
	// Not ws() != 0: a NUL byte is not the end of the body.
	if s.ws(); s.pos < len(s.buf) {
		return s.unexpected("after top-level value")
	}
	return true
}

// decodeInto is decodeString into *space, which keeps what it decoded:
// a string that needed no decoding comes back as raw itself, which lies in
// someone else's bytes (the request's body, sent on as it came; the
// proxy's read buffer, written to the client), and *space must never
// become it, or the next decoding would write over them.
func decodeInto(space *[]byte, raw []byte, escaped bool) []byte {
	d := decodeString((*space)[:0], raw, escaped)
	if len(d) > 0 && len(raw) > 0 && &d[0] == &raw[0] {
		return d
	}
	*space = d
	return d
}

// decodeString returns the string value of raw (a string's contents as
// scanned) as encoding/json decodes it: escapes resolved, invalid UTF-8
// and unpaired surrogates replaced with U+FFFD. Plain ASCII is returned
// as is; anything else is decoded into dst[:0].
func decodeString(dst, raw []byte, escaped bool) []byte {
	if !escaped {
		ascii := true
		for _, c := range raw {
			if c >= utf8.RuneSelf {
				ascii = false
				break
			}
		}
		if ascii || utf8.Valid(raw) {
			return raw
		}
	}
	b := dst[:0]
	for r := 0; r < len(raw); {
		c := raw[r]
		switch {
		case c == '\\':
			switch raw[r+1] {
			case 'b':
				b = append(b, '\b')
			case 'f':
				b = append(b, '\f')
			case 'n':
				b = append(b, '\n')
			case 'r':
				b = append(b, '\r')
			case 't':
				b = append(b, '\t')
			case 'u':
				rr := hex4(raw[r+2:])
				r += 6
				if utf16.IsSurrogate(rr) {
					if r+6 <= len(raw) && raw[r] == '\\' && raw[r+1] == 'u' {
						if dec := utf16.DecodeRune(rr, hex4(raw[r+2:])); dec != unicode.ReplacementChar {
							b = utf8.AppendRune(b, dec)
							r += 6
							continue
						}
					}
					rr = unicode.ReplacementChar
				}
				b = utf8.AppendRune(b, rr)
				continue
			default: // '"', '\\', '/'
				b = append(b, raw[r+1])
			}
			r += 2
		case c < utf8.RuneSelf:
			b = append(b, c)
			r++
		default:
			rr, size := utf8.DecodeRune(raw[r:])
			b = utf8.AppendRune(b, rr)
			r += size
		}
	}
	return b
}

// hex4 decodes the four hex digits (already validated) at the start of p.
func hex4(p []byte) rune {
	var r rune
	for _, c := range p[:4] {
		switch {
		case c <= '9':
			c -= '0'
		case c <= 'F':
			c -= 'A' - 10
		default:
			c -= 'a' - 10
		}
		r = r<<4 | rune(c)
	}
	return r
}

// parseInt reads an integer literal that fits in an int64; numbers with
// a fraction or exponent, or out of range, are not integers (as
// encoding/json decodes into an int).
func parseInt(p []byte) (int64, bool) {
	neg := len(p) > 0 && p[0] == '-'
	if neg {
		p = p[1:]
	}
	if len(p) == 0 {
		return 0, false
	}
	if len(p) <= 18 {
		// Eighteen digits cannot overflow: only digits to check, as in
		// every count and limit a body or a usage has.
		var n int64
		for _, c := range p {
			d := c - '0'
			if d > 9 {
				return 0, false
			}
			n = n*10 + int64(d)
		}
		if neg {
			n = -n
		}
		return n, true
	}
	const limit = uint64(1) << 63 // |min|; max is limit-1
	var n uint64
	for _, c := range p {
		d := uint64(c - '0')
		if d > 9 || n > (limit+9)/10 {
			return 0, false
		}
		n = n*10 + d
		if n > limit {
			return 0, false
		}
	}
	if neg {
		return -int64(n), true // n == limit is min
	}
	if n == limit {
		return 0, false
	}
	return int64(n), true
}

package tg

import (
	"strings"
	"unicode/utf16"
	"unicode/utf8"
)

// MaxMessage is Telegram's limit on a message's text, counted as the Bot
// API counts it: in UTF-16 code units.
const MaxMessage = 4096

// Split cuts text into messages of at most max UTF-16 code units each,
// preferring a line break, then a space, in the last quarter of a part;
// it never cuts inside a character. Empty text gives no parts.
func Split(text string, max int) []string {
	var parts []string
	for text != "" {
		if units(text) <= max {
			parts = append(parts, text)
			break
		}
		// The longest prefix within max code units.
		end, n := 0, 0
		for end < len(text) {
			r, size := utf8.DecodeRuneInString(text[end:])
			w := utf16.RuneLen(r)
			if w < 0 {
				w = 1
			}
			if n+w > max {
				break
			}
			n += w
			end += size
		}
		cut := end
		if i := strings.LastIndexByte(text[:end], '\n'); i >= end*3/4 && i > 0 {
			cut = i + 1
		} else if i := strings.LastIndexByte(text[:end], ' '); i >= end*3/4 && i > 0 {
			cut = i + 1
		}
		parts = append(parts, text[:cut])
		text = text[cut:]
	}
	return parts
}

// units is the length of s in UTF-16 code units.
func units(s string) int {
	n := 0
	for _, r := range s {
		if w := utf16.RuneLen(r); w > 0 {
			n += w
		} else {
			n++
		}
	}
	return n
}

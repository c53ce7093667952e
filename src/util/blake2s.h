/* Keyed BLAKE2s (RFC 7693), used as a MAC over handle bytes. BLAKE2s rather
 * than HMAC-SHA-256: it takes a key natively (one pass, no inner/outer hash),
 * is as fast as SHA-256 without SHA extensions on 32-bit words, and fits in a
 * few hundred lines with no dependency, so every backend gets the same MAC.
 * Private to the core (usmipc__ prefix); not part of the public API. */
#ifndef USMIPC_BLAKE2S_H
#define USMIPC_BLAKE2S_H

#include <stddef.h>
#include <stdint.h>

#define USMIPC__BLAKE2S_BLOCK 64
#define USMIPC__BLAKE2S_MAX_OUT 32
#define USMIPC__BLAKE2S_MAX_KEY 32
#define USMIPC__MAC_LEN 16
#define USMIPC__MAC_KEY_LEN 16

typedef struct usmipc__blake2s {
  uint32_t h[8]; /* chained state */
  uint32_t t[2]; /* bytes compressed so far, low and high words */
  uint32_t f[2]; /* finalization flags: f[0] is all ones for the last block */
  uint8_t buf[64];
  size_t buflen; /* bytes waiting in buf, 0..64 */
  size_t outlen;
} usmipc__blake2s_t;

/* outlen 1..32 and keylen 0..32 (key may be NULL when keylen is 0). Other
 * lengths are a bug in the caller, never untrusted input, so they abort. */
void usmipc__blake2s_init(usmipc__blake2s_t *s, size_t outlen, const void *key,
                          size_t keylen);
void usmipc__blake2s_update(usmipc__blake2s_t *s, const void *data, size_t len);
/* Writes s->outlen bytes to out and wipes s (it holds key material); s must
 * be initialised again before reuse. */
void usmipc__blake2s_final(usmipc__blake2s_t *s, void *out);

/* Keyed BLAKE2s with a 16-byte key and a 16-byte tag. */
void usmipc__mac(uint8_t out[16], const uint8_t key[16], const void *data,
                 size_t len);

/* 1 when the n bytes at a and b are equal, else 0, taking the same time
 * whatever the bytes are, so a forger cannot learn a tag byte by byte from
 * how long a comparison took (memcmp stops at the first difference). */
/* The same MAC with the key block compressed once, for many messages under
 * one key: usmipc__mac_keyed(out, &keyed, data, len) equals
 * usmipc__mac(out, key, data, len) for len > 0. */
void usmipc__mac_keyed_init(usmipc__blake2s_t *keyed, const uint8_t key[16]);
void usmipc__mac_keyed(uint8_t out[16], const usmipc__blake2s_t *keyed,
                       const void *data, size_t len);

int usmipc__ct_equal(const void *a, const void *b, size_t n);

#endif /* USMIPC_BLAKE2S_H */

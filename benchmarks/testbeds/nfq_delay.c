/* Hold every packet of one NFQUEUE queue for a fixed delay, then accept it: one-way latency in user space.

   Built and started by benchmarks/netem.py inside the server's network namespace, where iptables sends
   the packets of the veth link (both directions) to this queue. Why a C helper and not Python: at a few
   hundred MB/s a Python callback per packet would take a core of a 2-core machine and become the
   bottleneck it is meant to emulate.

   Model: a packet's release time is its arrival time plus the delay. The delay is the same for every
   packet, so release order is arrival order and a FIFO ring is the whole schedule; packets are never
   serialised behind each other, so the link's bandwidth is not throttled. Verdicts go out in batches
   (nfq_set_verdict_batch accepts every id up to the given one: ids rise in arrival order in one queue).
   Packets are queued as metadata only (no payload copy) and GSO super-packets are not split (F_GSO),
   which keeps the packet rate this process sees low.

   stdin: one line per change, the new one-way delay in microseconds (applies to packets arriving from
   then on). SIGTERM/SIGINT or EOF on stdin: accept whatever is held and exit. Counters go to stderr. */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <linux/netfilter.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define RING (1u << 18)

static uint32_t ids[RING];
static int64_t due[RING];
static uint32_t head, tail; /* held packets: [head, tail) modulo RING */
static int64_t delay_ns;
static unsigned long long seen, dropped_full, max_held;
static volatile sig_atomic_t stop;

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int on_packet(struct nfq_q_handle *qh, struct nfgenmsg *msg, struct nfq_data *nfa, void *data) {
    (void)msg; (void)data;
    struct nfqnl_msg_packet_hdr *ph = nfq_get_msg_packet_hdr(nfa);
    if (!ph) return 0;
    uint32_t id = ntohl(ph->packet_id);
    seen++;
    if (tail - head >= RING) { /* never expected: drop, as a full router queue would */
        dropped_full++;
        return nfq_set_verdict(qh, id, NF_DROP, 0, NULL);
    }
    ids[tail % RING] = id;
    due[tail % RING] = now_ns() + delay_ns;
    tail++;
    if (tail - head > max_held) max_held = tail - head;
    return 0;
}

/* Accept every held packet whose time has come; returns ns until the next one is due (-1: none held). */
static int64_t release(struct nfq_q_handle *qh, int all) {
    int64_t t = now_ns();
    uint32_t last = head;
    while (head != tail && (all || due[head % RING] <= t)) head++;
    if (head != last) nfq_set_verdict_batch(qh, ids[(head - 1) % RING], NF_ACCEPT);
    return head == tail ? -1 : due[head % RING] - t;
}

static void on_signal(int s) { (void)s; stop = 1; }

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s QUEUE_NUM DELAY_US\n", argv[0]);
        return 2;
    }
    int qnum = atoi(argv[1]);
    delay_ns = atoll(argv[2]) * 1000LL;
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    signal(SIGPIPE, SIG_IGN);

    struct nfq_handle *h = nfq_open();
    if (!h) { perror("nfq_open"); return 1; }
    struct nfq_q_handle *qh = nfq_create_queue(h, (uint16_t)qnum, &on_packet, NULL);
    if (!qh) { perror("nfq_create_queue"); return 1; }
    if (nfq_set_mode(qh, NFQNL_COPY_META, 0) < 0) { perror("nfq_set_mode"); return 1; }
    nfq_set_queue_maxlen(qh, 1u << 16);
    nfq_set_queue_flags(qh, NFQA_CFG_F_GSO, NFQA_CFG_F_GSO);
    nfnl_rcvbufsiz(nfq_nfnlh(h), 64u << 20);
    int fd = nfq_fd(h);
    fprintf(stderr, "nfq_delay: queue %d, one-way delay %lld us\n", qnum, (long long)(delay_ns / 1000));
    fprintf(stdout, "ready\n");
    fflush(stdout);

    char buf[1 << 16];
    char line[64];
    size_t line_len = 0;
    int stdin_open = 1;
    while (!stop) {
        int64_t wait = release(qh, 0);
        struct timespec ts = {0, 0}, *tp = NULL;
        if (wait >= 0) { ts.tv_sec = wait / 1000000000LL; ts.tv_nsec = wait % 1000000000LL; tp = &ts; }
        struct pollfd p[2] = {{fd, POLLIN, 0}, {0, POLLIN, 0}};
        int n = ppoll(p, stdin_open ? 2 : 1, tp, NULL);
        if (n < 0) { if (errno == EINTR) continue; perror("ppoll"); break; }
        if (p[0].revents & POLLIN) {
            for (;;) { /* drain what the kernel has queued, without blocking */
                ssize_t r = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
                if (r > 0) { nfq_handle_packet(h, buf, (int)r); continue; }
                if (r < 0 && errno == ENOBUFS) { fprintf(stderr, "nfq_delay: ENOBUFS (kernel dropped packets)\n"); continue; }
                break;
            }
        }
        if (stdin_open && (p[1].revents & (POLLIN | POLLHUP))) {
            char c;
            ssize_t r = read(0, &c, 1);
            if (r <= 0) { stdin_open = 0; stop = 1; continue; }
            if (c == '\n') {
                line[line_len] = 0;
                delay_ns = atoll(line) * 1000LL;
                line_len = 0;
                fprintf(stdout, "delay %lld\n", (long long)(delay_ns / 1000));
                fflush(stdout);
            } else if (line_len + 1 < sizeof line) {
                line[line_len++] = c;
            }
        }
    }
    release(qh, 1);
    fprintf(stderr, "nfq_delay: %llu packets, at most %llu held, %llu dropped (ring full)\n", seen, max_held, dropped_full);
    nfq_destroy_queue(qh);
    nfq_close(h);
    return 0;
}

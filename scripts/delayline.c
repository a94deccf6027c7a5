/* A user-space delay line for the network testbed (scripts/netbed.py, scripts/wanlink.py).
 *
 * One process per WAN link. It creates two TAP devices, side A (the host's or
 * NAT router's `eth0`) inside namespace --a-ns and side B (the switch's
 * `port<i>`) inside --b-ns, and moves Ethernet frames between them through a
 * timed FIFO per direction: up is A -> B, down is B -> A. A frame arriving at
 * time t is dropped with probability `loss` (IP frames only: losing ARP would
 * lose every packet behind an unresolved neighbour, which a WAN does not), else
 * released at
 *     max(previous release, t + delay + uniform(0, jitter))
 * so jitter never reorders frames. Each direction's queue is bounded in bytes;
 * a frame that would overflow it is dropped and counted.
 *
 * Rate is not shaped here: tbf on the TAP egresses does that before a frame
 * reaches this process (serialisation first, then propagation, as on a line).
 *
 * It runs at real-time priority (SCHED_FIFO 10, when allowed) so that CPU-bound
 * hosts on the same machine do not delay its frames.
 *
 * Lifecycle: prints "ready" on stdout once both TAPs exist, then stays in
 * --b-ns (so `ip netns pids` of the switch finds it). It dies with its parent
 * (PR_SET_PDEATHSIG) unless SIGUSR2 detaches it (a testbed handed over with
 * keep()). SIGUSR1 writes the counters to --stats; SIGTERM/SIGINT write them
 * and exit 0. Bad arguments: one line on stderr naming the flag, exit 2.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <getopt.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/timerfd.h>
#include <time.h>
#include <unistd.h>

#define MAX_FRAME 65536
#define MAX_DELAY_US 10000000ULL      /* 10 s one way */
#define MAX_QUEUE_BYTES (1ULL << 32)  /* 4 GiB */

struct frame {
    struct frame *next;
    uint64_t release_ns;
    uint32_t len;
    unsigned char data[];
};

struct direction {
    const char *name;
    int in_fd, out_fd;
    uint64_t delay_ns, jitter_ns;
    double loss;
    uint64_t queue_limit, queued_bytes, queued_max, last_release_ns;
    struct frame *head, *tail;
    uint64_t frames_in, bytes_in, frames_out, bytes_out;
    uint64_t drop_loss, drop_queue, drop_write;
};

static uint64_t rng_state = 0x9e3779b97f4a7c15ULL;

static uint64_t rng_next(void) { /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545f4914f6cdd1dULL;
}

static double rng_unit(void) { return (rng_next() >> 11) * (1.0 / 9007199254740992.0); }

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

static void die(const char *what) {
    fprintf(stderr, "delayline: %s: %s\n", what, strerror(errno));
    exit(1);
}

static void usage_error(const char *flag, const char *value, const char *expect) {
    fprintf(stderr, "delayline: %s must be %s, got '%s'\n", flag, expect, value ? value : "");
    exit(2);
}

static uint64_t parse_u64(const char *flag, const char *s, uint64_t max, const char *expect) {
    char *end;
    errno = 0;
    if (!s || !*s || *s == '-' || *s == '+')
        usage_error(flag, s, expect);
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || *end || v > max)
        usage_error(flag, s, expect);
    return v;
}

static double parse_probability(const char *flag, const char *s) {
    char *end;
    errno = 0;
    double v = s && *s ? strtod(s, &end) : -1;
    if (!s || !*s || errno || *end || !(v >= 0.0 && v < 1.0))
        usage_error(flag, s, "a probability in [0, 1)");
    return v;
}

static int open_tap(const char *ns, const char *dev) {
    char path[300];
    snprintf(path, sizeof path, "/run/netns/%s", ns);
    int nsfd = open(path, O_RDONLY | O_CLOEXEC);
    if (nsfd < 0)
        die(path);
    if (setns(nsfd, CLONE_NEWNET) < 0)
        die("setns");
    close(nsfd);
    int fd = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0)
        die("/dev/net/tun");
    struct ifreq ifr;
    memset(&ifr, 0, sizeof ifr);
    ifr.ifr_flags = IFF_TAP | IFF_NO_PI;
    snprintf(ifr.ifr_name, IFNAMSIZ, "%s", dev);
    if (ioctl(fd, TUNSETIFF, &ifr) < 0)
        die(dev);
    return fd;
}

static void write_stats(const char *path, struct direction *dirs, int detached) {
    if (!path)
        return;
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f)
        return;
    fprintf(f, "{\"pid\": %d, \"detached\": %d", (int)getpid(), detached);
    for (int d = 0; d < 2; d++) {
        struct direction *x = &dirs[d];
        fprintf(f, ", \"%s\": {\"frames_in\": %llu, \"bytes_in\": %llu, \"frames_out\": %llu, \"bytes_out\": %llu, "
                   "\"drop_loss\": %llu, \"drop_queue\": %llu, \"drop_write\": %llu, \"queued_bytes\": %llu, "
                   "\"queued_max\": %llu}",
                x->name, (unsigned long long)x->frames_in, (unsigned long long)x->bytes_in,
                (unsigned long long)x->frames_out, (unsigned long long)x->bytes_out,
                (unsigned long long)x->drop_loss, (unsigned long long)x->drop_queue,
                (unsigned long long)x->drop_write, (unsigned long long)x->queued_bytes,
                (unsigned long long)x->queued_max);
    }
    fprintf(f, "}\n");
    if (fclose(f) == 0)
        rename(tmp, path);
}

/* Read every frame waiting on the direction's input; each is lost, dropped for space, or queued. */
static void take_frames(struct direction *x, unsigned char *buf) {
    for (;;) {
        ssize_t n = read(x->in_fd, buf, MAX_FRAME);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            if (errno == EAGAIN || errno == EWOULDBLOCK)
                return;
            die("read");
        }
        if (n == 0)
            return;
        uint64_t t = now_ns();
        x->frames_in++;
        x->bytes_in += (uint64_t)n;
        int is_ip = n >= 14 && ((buf[12] == 0x08 && buf[13] == 0x00) || (buf[12] == 0x86 && buf[13] == 0xdd));
        if (is_ip && x->loss > 0 && rng_unit() < x->loss) {
            x->drop_loss++;
            continue;
        }
        if (x->queued_bytes + (uint64_t)n > x->queue_limit) {
            x->drop_queue++;
            continue;
        }
        struct frame *fr = malloc(sizeof *fr + (size_t)n);
        if (!fr) {
            x->drop_queue++;
            continue;
        }
        uint64_t extra = x->jitter_ns ? (uint64_t)(rng_unit() * (double)x->jitter_ns) : 0;
        uint64_t release = t + x->delay_ns + extra;
        if (release < x->last_release_ns)
            release = x->last_release_ns; /* jitter never reorders */
        x->last_release_ns = release;
        fr->next = NULL;
        fr->release_ns = release;
        fr->len = (uint32_t)n;
        memcpy(fr->data, buf, (size_t)n);
        if (x->tail)
            x->tail->next = fr;
        else
            x->head = fr;
        x->tail = fr;
        x->queued_bytes += (uint64_t)n;
        if (x->queued_bytes > x->queued_max)
            x->queued_max = x->queued_bytes;
    }
}

/* Write every frame whose release time has come. */
static void release_frames(struct direction *x, uint64_t now) {
    while (x->head && x->head->release_ns <= now) {
        struct frame *fr = x->head;
        ssize_t n;
        do
            n = write(x->out_fd, fr->data, fr->len);
        while (n < 0 && errno == EINTR);
        if (n == (ssize_t)fr->len) {
            x->frames_out++;
            x->bytes_out += fr->len;
        } else {
            x->drop_write++;
        }
        x->head = fr->next;
        if (!x->head)
            x->tail = NULL;
        x->queued_bytes -= fr->len;
        free(fr);
    }
}

int main(int argc, char **argv) {
    const char *a_ns = NULL, *a_dev = NULL, *b_ns = NULL, *b_dev = NULL, *stats = NULL;
    struct direction dirs[2] = {{.name = "up"}, {.name = "down"}};
    struct direction *up = &dirs[0], *down = &dirs[1];
    uint64_t queue_bytes = 64ULL << 20, parent = 0;
    static const struct option opts[] = {
        {"a-ns", 1, 0, 'a'}, {"a-dev", 1, 0, 'A'}, {"b-ns", 1, 0, 'b'}, {"b-dev", 1, 0, 'B'},
        {"up-delay-us", 1, 0, 'd'}, {"down-delay-us", 1, 0, 'D'}, {"up-jitter-us", 1, 0, 'j'},
        {"down-jitter-us", 1, 0, 'J'}, {"up-loss", 1, 0, 'l'}, {"down-loss", 1, 0, 'L'},
        {"queue-bytes", 1, 0, 'q'}, {"seed", 1, 0, 's'}, {"stats", 1, 0, 'S'}, {"parent", 1, 0, 'p'},
        {0, 0, 0, 0}};
    const char *us = "microseconds, 0-10000000";
    int c;
    opterr = 0;
    while ((c = getopt_long(argc, argv, "", opts, NULL)) != -1) {
        switch (c) {
        case 'a': a_ns = optarg; break;
        case 'A': a_dev = optarg; break;
        case 'b': b_ns = optarg; break;
        case 'B': b_dev = optarg; break;
        case 'd': up->delay_ns = parse_u64("--up-delay-us", optarg, MAX_DELAY_US, us) * 1000; break;
        case 'D': down->delay_ns = parse_u64("--down-delay-us", optarg, MAX_DELAY_US, us) * 1000; break;
        case 'j': up->jitter_ns = parse_u64("--up-jitter-us", optarg, MAX_DELAY_US, us) * 1000; break;
        case 'J': down->jitter_ns = parse_u64("--down-jitter-us", optarg, MAX_DELAY_US, us) * 1000; break;
        case 'l': up->loss = parse_probability("--up-loss", optarg); break;
        case 'L': down->loss = parse_probability("--down-loss", optarg); break;
        case 'q': queue_bytes = parse_u64("--queue-bytes", optarg, MAX_QUEUE_BYTES, "bytes, 2048-4294967296"); break;
        case 's': rng_state = parse_u64("--seed", optarg, UINT64_MAX, "an unsigned integer") | 1; break;
        case 'S': stats = optarg; break;
        case 'p': parent = parse_u64("--parent", optarg, 1u << 30, "a pid"); break;
        default:
            fprintf(stderr, "delayline: unknown or incomplete option '%s'\n", argv[optind - 1]);
            return 2;
        }
    }
    if (optind < argc) {
        fprintf(stderr, "delayline: unexpected argument '%s'\n", argv[optind]);
        return 2;
    }
    const char *names[] = {"--a-ns", "--a-dev", "--b-ns", "--b-dev"}, *values[] = {a_ns, a_dev, b_ns, b_dev};
    for (int i = 0; i < 4; i++)
        if (!values[i] || !*values[i] || strlen(values[i]) >= (i % 2 ? IFNAMSIZ : 256) || strchr(values[i], '/'))
            usage_error(names[i], values[i], i % 2 ? "an interface name (1-15 characters)" : "a namespace name");
    if (queue_bytes < 2048)
        usage_error("--queue-bytes", "too small", "bytes, 2048-4294967296");
    up->queue_limit = down->queue_limit = queue_bytes;

    /* Die with the parent, and if it is already gone, now. */
    if (parent) {
        if (prctl(PR_SET_PDEATHSIG, SIGTERM) < 0)
            die("prctl");
        if ((uint64_t)getppid() != parent)
            return 1;
    }
    prctl(PR_SET_TIMERSLACK, 1UL);

    int a_fd = open_tap(a_ns, a_dev);
    int b_fd = open_tap(b_ns, b_dev); /* and stay in b's namespace */
    up->in_fd = a_fd, up->out_fd = b_fd;
    down->in_fd = b_fd, down->out_fd = a_fd;

    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGTERM), sigaddset(&mask, SIGINT), sigaddset(&mask, SIGUSR1), sigaddset(&mask, SIGUSR2);
    sigaddset(&mask, SIGHUP);
    if (sigprocmask(SIG_BLOCK, &mask, NULL) < 0)
        die("sigprocmask");
    signal(SIGPIPE, SIG_IGN);
    int sig_fd = signalfd(-1, &mask, SFD_NONBLOCK | SFD_CLOEXEC);
    int timer_fd = timerfd_create(CLOCK_MONOTONIC, TFD_NONBLOCK | TFD_CLOEXEC);
    int ep = epoll_create1(EPOLL_CLOEXEC);
    if (sig_fd < 0 || timer_fd < 0 || ep < 0)
        die("signalfd/timerfd/epoll");
    int fds[] = {a_fd, b_fd, sig_fd, timer_fd};
    for (int i = 0; i < 4; i++) {
        struct epoll_event ev = {.events = EPOLLIN, .data.fd = fds[i]};
        if (epoll_ctl(ep, EPOLL_CTL_ADD, fds[i], &ev) < 0)
            die("epoll_ctl");
    }

    /* A wire does not wait for a CPU: the hosts beside it on this machine may keep every core
     * busy (a test suite, a benchmark), and a frame held behind them arrives late. Real-time
     * priority lets the line run as soon as a frame or its release time is due; it sleeps in
     * epoll_wait otherwise. Not allowed (no CAP_SYS_NICE): it runs as before. */
    struct sched_param rt = {.sched_priority = 10};
    if (sched_setscheduler(0, SCHED_FIFO, &rt) < 0)
        fprintf(stderr, "delayline: real-time priority refused (%s); frames may be late under CPU load\n",
                strerror(errno));

    int detached = 0;
    write_stats(stats, dirs, detached);
    printf("ready\n");
    fflush(stdout);
    int devnull = open("/dev/null", O_WRONLY);
    if (devnull >= 0)
        dup2(devnull, STDOUT_FILENO), close(devnull); /* the parent stops reading after "ready" */

    static unsigned char buf[MAX_FRAME];
    uint64_t armed = 0;
    for (;;) {
        struct epoll_event evs[8];
        int n = epoll_wait(ep, evs, 8, -1);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            die("epoll_wait");
        }
        for (int i = 0; i < n; i++) {
            int fd = evs[i].data.fd;
            if (fd == a_fd)
                take_frames(up, buf);
            else if (fd == b_fd)
                take_frames(down, buf);
            else if (fd == timer_fd) {
                uint64_t expirations;
                if (read(timer_fd, &expirations, sizeof expirations) < 0 && errno != EAGAIN)
                    die("timerfd");
                armed = 0;
            } else if (fd == sig_fd) {
                struct signalfd_siginfo si;
                while (read(sig_fd, &si, sizeof si) == (ssize_t)sizeof si) {
                    if (si.ssi_signo == SIGUSR2) {
                        prctl(PR_SET_PDEATHSIG, 0);
                        detached = 1;
                    } else if (si.ssi_signo != SIGUSR1) {
                        write_stats(stats, dirs, detached);
                        for (int d = 0; d < 2; d++)
                            fprintf(stderr, "delayline %s: %llu frames in, %llu out, dropped %llu loss %llu queue "
                                            "%llu write\n", dirs[d].name, (unsigned long long)dirs[d].frames_in,
                                    (unsigned long long)dirs[d].frames_out, (unsigned long long)dirs[d].drop_loss,
                                    (unsigned long long)dirs[d].drop_queue, (unsigned long long)dirs[d].drop_write);
                        return 0;
                    }
                    write_stats(stats, dirs, detached);
                }
            }
        }
        uint64_t now = now_ns();
        release_frames(up, now);
        release_frames(down, now);
        /* Arm the timer for the earliest frame still queued (absolute, so a late wakeup never drifts). */
        uint64_t next = 0;
        for (int d = 0; d < 2; d++)
            if (dirs[d].head && (!next || dirs[d].head->release_ns < next))
                next = dirs[d].head->release_ns;
        if (next && next != armed) {
            struct itimerspec its = {.it_value = {.tv_sec = next / 1000000000ULL, .tv_nsec = next % 1000000000ULL}};
            if (timerfd_settime(timer_fd, TFD_TIMER_ABSTIME, &its, NULL) < 0)
                die("timerfd_settime");
            armed = next;
        }
    }
}

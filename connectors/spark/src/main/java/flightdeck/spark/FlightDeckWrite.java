package flightdeck.spark;

import java.io.IOException;
import java.util.ArrayList;
import java.util.LinkedHashSet;
import java.util.List;
import java.util.Optional;
import java.util.Set;
import java.util.SortedMap;
import java.util.TreeMap;
import org.apache.arrow.flight.FlightClient;
import org.apache.arrow.flight.FlightDescriptor;
import org.apache.arrow.flight.FlightRuntimeException;
import org.apache.arrow.flight.PutResult;
import org.apache.arrow.flight.SyncPutListener;
import org.apache.arrow.memory.ArrowBuf;
import org.apache.arrow.memory.BufferAllocator;
import org.apache.arrow.vector.VectorSchemaRoot;
import org.apache.spark.TaskContext;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.connector.write.BatchWrite;
import org.apache.spark.sql.connector.write.DataWriter;
import org.apache.spark.sql.connector.write.DataWriterFactory;
import org.apache.spark.sql.connector.write.PhysicalWriteInfo;
import org.apache.spark.sql.connector.write.SupportsTruncate;
import org.apache.spark.sql.connector.write.Write;
import org.apache.spark.sql.connector.write.WriteBuilder;
import org.apache.spark.sql.connector.write.WriterCommitMessage;
import org.apache.spark.sql.execution.arrow.ArrowWriter;
import org.apache.spark.sql.internal.SQLConf;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.ArrowUtils;

/**
 * The write side. Every task streams its partition to its server as
 * attempt {@code TaskContext.attemptNumber()} of partition
 * {@code partitionId()}, in record batches Spark's own {@link ArrowWriter}
 * fills, with the explicit-commit marker ({@code PutCommit{rows}}) last, so
 * a task that dies half-way stores nothing; its commit message names the
 * attempt and the server holding it. The driver's commit seals the dataset
 * with exactly those winners (a cluster seal when they are on several
 * servers), so retried and speculative tasks never duplicate rows; abort
 * drops what the job wrote. {@code overwrite} replaces a dataset at the end
 * of the job: its rows are staged beside the dataset, which readers keep
 * reading, and the seal swaps them in at once; a failed job leaves the old
 * dataset as it was. {@code append} creates a dataset and refuses an
 * existing one (a sealed dataset is immutable).
 */
final class FlightDeckWrite {
  private FlightDeckWrite() {}

  /** Builds the write: truncate() is Spark's overwrite. */
  static final class Builder implements WriteBuilder, SupportsTruncate {
    private final Options options;
    private final StructType schema;
    private boolean overwrite;

    Builder(Options options, StructType schema) {
      if (!options.filter().isEmpty()) {
        throw new IllegalArgumentException("option filter selects the rows a read sends; a write "
            + "stores every row of the DataFrame: filter the DataFrame before writing it");
      }
      this.options = options;
      this.schema = schema;
    }

    @Override
    public WriteBuilder truncate() {
      overwrite = true;
      return this;
    }

    @Override
    public Write build() {
      Options o = options;
      StructType s = schema;
      boolean replace = overwrite;
      return new Write() {
        @Override
        public String description() {
          return "flightdeck dataset '" + o.dataset() + "'";
        }

        @Override
        public BatchWrite toBatch() {
          // Fails before any task starts: a type Arrow cannot carry, or an
          // existing dataset to append to.
          checkTypes(s);
          prepare(o, replace);
          SQLConf conf = SQLConf.get();
          return new Batch(o.withDefaultBatchRows(conf.arrowMaxRecordsPerBatch()), s,
              conf.sessionLocalTimeZone(), java.util.UUID.randomUUID().toString().replace("-", ""),
              replace);
        }
      };
    }
  }

  /**
   * Refuses, naming it, a column Arrow cannot carry, and a Spark ML vector
   * (stored, it would be Spark's internal struct, which no reader trains on).
   */
  static void checkTypes(StructType schema) {
    for (var field : schema.fields()) {
      String type = field.dataType().getClass().getName();
      if (type.equals("org.apache.spark.ml.linalg.VectorUDT")
          || type.equals("org.apache.spark.mllib.linalg.VectorUDT")) {
        throw new IllegalArgumentException("column '" + field.name() + "' is a Spark ML vector, "
            + "which would be stored as Spark's internal struct (type, size, indices, values) "
            + "that no reader trains on: convert it to an array first, "
            + "org.apache.spark.ml.functions.vector_to_array(col(\"" + field.name()
            + "\"), \"float32\") (Scala, Java) or flightdeck.spark.vectors_to_arrays(df) "
            + "(PySpark)");
      }
      try {
        ArrowUtils.toArrowSchema(new StructType().add(field), "UTC", true);
      } catch (RuntimeException e) {
        throw new IllegalArgumentException(
            "column '" + field.name() + "' has type " + field.dataType().simpleString()
                + ", which flightdeck cannot store (no Arrow type for it): cast or drop it first"
                + (e.getMessage() == null ? "" : " (" + e.getMessage() + ")"),
            e);
      }
    }
  }

  /**
   * On the driver, before any task: every server is reachable, and (append)
   * none holds the dataset. An overwrite leaves the dataset alone: the write
   * replaces it when sealed.
   */
  static void prepare(Options options, boolean overwrite) {
    for (String target : new LinkedHashSet<>(options.targets())) {
      try (Server server = Server.open(target, options.token())) {
        Optional<Wire.DatasetInfo> info = server.describe(options.dataset());
        if (info.isEmpty()) {
          continue;
        }
        if (overwrite) {
          continue;
        }
        Wire.DatasetInfo held = info.get();
        if (held.sealed()) {
          throw new FlightDeckException(
              "FAILED_PRECONDITION",
              "cannot append to dataset '" + options.dataset() + "': it already exists (sealed, "
                  + held.rows() + " rows) and a flightdeck dataset is immutable once sealed; use "
                  + "mode(\"overwrite\") to replace it, or write to a new dataset name");
        }
        if (held.sealing()) {
          throw new FlightDeckException("FAILED_PRECONDITION", "cannot append to dataset '"
              + options.dataset() + "': " + Server.unfinishedSeal(options.dataset(), target));
        }
        throw new FlightDeckException(
            "FAILED_PRECONDITION",
            "cannot append to dataset '" + options.dataset() + "': another write of it is under "
                + "way or was left unfinished (" + held.rows() + " rows, last written "
                + Math.round(held.writtenSecondsAgo()) + "s ago, never sealed); if the job "
                + "writing it is gone, mode(\"overwrite\") replaces what it left (or drop it "
                + "first: flightdeck drop " + options.dataset() + " --server " + target + ")");
      }
    }
  }

  /** What a task tells the driver: which attempt holds its partition, where. */
  record Committed(int partition, int attempt, String location, long rows, long bytes)
      implements WriterCommitMessage {}

  /** The job: a writer factory for the tasks, seal on commit, drop on abort. */
  static final class Batch implements BatchWrite {
    private final Options options;
    private final StructType schema;
    private final String timeZone;
    /** This job's id, sent with every attempt and named when it aborts. */
    private final String writeId;
    /** Whether the job replaces the dataset (an overwrite). */
    private final boolean replace;

    Batch(Options options, StructType schema, String timeZone, String writeId, boolean replace) {
      this.options = options;
      this.schema = schema;
      this.timeZone = timeZone;
      this.writeId = writeId;
      this.replace = replace;
    }

    @Override
    public DataWriterFactory createBatchWriterFactory(PhysicalWriteInfo info) {
      return new Factory(options, schema, timeZone, writeId, replace);
    }

    /**
     * No: the server decides which attempt of a partition counts (the seal
     * names each partition's winner and frees the others), so Spark's
     * coordinator adds nothing. Asking it would also hide why a job failed:
     * a server refuses a task's stream (a reader's token, a full cache) as
     * the task finishes, and an attempt that asks once the job is failing is
     * denied, a denial Spark may report in place of the server's reason.
     */
    @Override
    public boolean useCommitCoordinator() {
      return false;
    }

    @Override
    public void commit(WriterCommitMessage[] messages) {
      SortedMap<String, SortedMap<Integer, Integer>> members = new TreeMap<>();
      Set<Integer> seen = new java.util.HashSet<>();
      for (WriterCommitMessage m : messages) {
        Committed c = (Committed) m;
        members.computeIfAbsent(c.location(), k -> new TreeMap<>()).put(c.partition(), c.attempt());
        seen.add(c.partition());
      }
      List<Integer> missing = new ArrayList<>();
      for (int p = 0; p < messages.length; p++) {
        if (!seen.contains(p)) {
          missing.add(p);
        }
      }
      if (!missing.isEmpty()) {
        throw new FlightDeckException(
            "INTERNAL",
            "no committed task for partitions " + missing + " of dataset '" + options.dataset() + "'");
      }
      String through = members.isEmpty() ? options.target(0) : members.firstKey();
      try (Server server = Server.open(through, options.token())) {
        server.action(
            "seal", Wire.seal(options.dataset(), messages.length, members, replace ? writeId : ""));
      }
      if (replace) {
        dropOlderCopies(seen);
      }
    }

    /**
     * After the overwrite's seal: drops the copies of the dataset on the
     * servers of {@code uris} the job routed none of {@code partitions} to,
     * which would otherwise go on serving the rows it replaced to readers
     * there (a copy written there alone, or a cluster layout of other
     * servers; the swap already dropped every layout one of its own servers
     * was part of). A server holding what this write swapped in keeps it; one
     * that cannot be reached keeps its copy, with a warning.
     */
    private void dropOlderCopies(Set<Integer> partitions) {
      Set<String> used = new java.util.HashSet<>();
      for (int p : partitions) {
        used.add(options.target(p));
      }
      for (String target : new LinkedHashSet<>(options.targets())) {
        if (used.contains(target)) {
          continue;
        }
        try (Server server = Server.open(target, options.token())) {
          server.drop(options.dataset(), "", false, writeId);
        } catch (FlightDeckException e) {
          if (!e.code.equals("FAILED_PRECONDITION")) {
            warnKept(target, e);
          }
        } catch (RuntimeException e) {
          warnKept(target, e);
        }
      }
    }

    private void warnKept(String target, RuntimeException e) {
      org.slf4j.LoggerFactory.getLogger(FlightDeckWrite.class).warn(
          "dataset '{}' was overwritten, but the older copy on {} could not be dropped ({}); "
              + "drop it there: flightdeck drop {} --server {}",
          options.dataset(), target, e.getMessage(), options.dataset(), target);
    }

    @Override
    public void abort(WriterCommitMessage[] messages) {
      Set<String> written = new LinkedHashSet<>();
      for (WriterCommitMessage m : messages) {
        if (m instanceof Committed c) {
          written.add(c.location());
        }
      }
      written.addAll(options.targets());
      for (String target : written) {
        try (Server server = Server.open(target, options.token())) {
          // Naming the write: a task still running is refused, not left
          // to bring the dataset back.
          server.drop(options.dataset(), writeId, replace, "");
        } catch (RuntimeException e) {
          // Best effort: the job's own failure is what the user sees.
        }
      }
    }
  }

  /** Serialized to the executors: makes each task's writer. */
  record Factory(
      Options options, StructType schema, String timeZone, String writeId, boolean replace)
      implements DataWriterFactory {
    @Override
    public DataWriter<InternalRow> createWriter(int partitionId, long taskId) {
      TaskContext ctx = TaskContext.get();
      int attempt = ctx == null ? 0 : ctx.attemptNumber();
      return new TaskWriter(options, schema, timeZone, writeId, replace, partitionId, attempt);
    }
  }

  /** One task's stream: rows into Arrow batches into a {@code DoPut}. */
  static final class TaskWriter implements DataWriter<InternalRow> {
    private final Options options;
    private final int partition;
    private final int attempt;
    private final BufferAllocator allocator;
    private final VectorSchemaRoot root;
    private final ArrowWriter arrow;
    private final Server server;
    private final SyncPutListener acks = new SyncPutListener();
    private final FlightClient.ClientStreamListener stream;
    private long rows;
    private int inBatch;
    private boolean ended;

    TaskWriter(Options options, StructType schema, String timeZone, String writeId,
        boolean replace, int partition, int attempt) {
      this.options = options;
      this.partition = partition;
      this.attempt = attempt;
      BufferAllocator a = ArrowUtils.rootAllocator()
          .newChildAllocator("flightdeck partition " + partition + " attempt " + attempt, 0, Long.MAX_VALUE);
      VectorSchemaRoot r = null;
      Server s = null;
      try {
        r = VectorSchemaRoot.create(ArrowUtils.toArrowSchema(schema, timeZone, true), a);
        s = Server.connect(options.target(partition), options.token(), a);
        FlightDescriptor descriptor =
            FlightDescriptor.command(
                Wire.putPartition(options.dataset(), partition, attempt, writeId, replace));
        this.stream = s.client.startPut(descriptor, r, acks, s.options);
      } catch (RuntimeException e) {
        // Spark closes only a writer it got: free what was made.
        if (s != null) {
          s.close();
        }
        if (r != null) {
          r.close();
        }
        a.close();
        throw e;
      }
      this.allocator = a;
      this.root = r;
      this.server = s;
      this.arrow = ArrowWriter.create(r);
    }

    /**
     * Waits until the transport takes more, so a partition is never
     * buffered whole. (Flight's client offers no ready callback once a call
     * has started, so it asks every 200 µs while the transport is full.)
     * Raises the server's error where it ended the call meanwhile.
     */
    private void awaitReady() throws IOException {
      while (!stream.isReady()) {
        if (acks.isCancelled()) {
          // The server ended the call (refused it, or failed): a stream
          // that ended is never ready again, so raise its error.
          try {
            stream.getResult();
          } catch (FlightRuntimeException e) {
            throw FlightDeckException.of(e, server.location);
          }
          throw new IOException("the server " + server.location + " ended the stream of partition "
              + partition + " of '" + options.dataset() + "' before it was sent");
        }
        java.util.concurrent.locks.LockSupport.parkNanos(200_000);
        if (Thread.interrupted()) {
          throw new IOException("interrupted sending partition " + partition);
        }
      }
    }

    @Override
    public void write(InternalRow row) throws IOException {
      arrow.write(row);
      rows++;
      if (++inBatch == options.batchRows()) {
        send();
      }
    }

    /** Sends the rows gathered so far as one record batch. */
    private void send() throws IOException {
      arrow.finish();
      awaitReady();
      stream.putNext();
      arrow.reset();
      inBatch = 0;
    }

    @Override
    public WriterCommitMessage commit() throws IOException {
      if (inBatch > 0) {
        send();
      }
      byte[] marker = Wire.putCommit(rows);
      ArrowBuf buf = allocator.buffer(marker.length);
      buf.writeBytes(marker);
      stream.putMetadata(buf);
      stream.completed();
      ended = true;
      try {
        stream.getResult();
        try (PutResult ack = acks.read()) {
          if (ack == null || ack.getApplicationMetadata() == null) {
            throw new FlightDeckException("INTERNAL",
                "the server " + server.location + " stored partition " + partition + " of '"
                    + options.dataset() + "' but sent no acknowledgement");
          }
          ArrowBuf meta = ack.getApplicationMetadata();
          byte[] body = new byte[(int) meta.readableBytes()];
          meta.getBytes(meta.readerIndex(), body);
          Wire.PutAck a = Wire.putAck(body);
          String location = a.location().isEmpty() ? server.location : a.location();
          return new Committed(partition, attempt, location, a.rows(), a.bytes());
        }
      } catch (FlightRuntimeException e) {
        throw FlightDeckException.of(e, server.location);
      } catch (java.util.concurrent.ExecutionException e) {
        if (e.getCause() instanceof FlightRuntimeException f) {
          throw FlightDeckException.of(f, server.location);
        }
        throw new IOException("storing partition " + partition + " failed: " + e.getCause(), e);
      } catch (InterruptedException e) {
        Thread.currentThread().interrupt();
        throw new IOException("interrupted waiting for the server to store partition " + partition, e);
      }
    }

    @Override
    public void abort() {
      if (!ended) {
        ended = true;
        // Resets the stream: the server stores nothing of this attempt.
        stream.error(new RuntimeException("Spark task aborted"));
      }
    }

    @Override
    public void close() {
      try {
        if (!ended) {
          abort();
        }
        acks.close();
        server.close();
      } finally {
        root.close();
        allocator.close();
      }
    }
  }
}

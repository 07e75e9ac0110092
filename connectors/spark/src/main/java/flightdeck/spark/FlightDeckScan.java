package flightdeck.spark;

import java.io.Serializable;
import java.util.ArrayList;
import java.util.Arrays;
import java.util.Comparator;
import java.util.HashSet;
import java.util.LinkedHashMap;
import java.util.List;
import java.util.Map;
import java.util.OptionalLong;
import java.util.Set;
import org.apache.arrow.flight.FlightDescriptor;
import org.apache.arrow.flight.FlightEndpoint;
import org.apache.arrow.flight.FlightInfo;
import org.apache.arrow.flight.FlightRuntimeException;
import org.apache.arrow.flight.FlightStream;
import org.apache.arrow.flight.Location;
import org.apache.arrow.memory.BufferAllocator;
import org.apache.arrow.vector.VectorSchemaRoot;
import org.apache.arrow.vector.types.pojo.Field;
import org.apache.arrow.vector.types.pojo.Schema;
import org.apache.spark.sql.catalyst.InternalRow;
import org.apache.spark.sql.connector.read.Batch;
import org.apache.spark.sql.connector.read.InputPartition;
import org.apache.spark.sql.connector.read.PartitionReader;
import org.apache.spark.sql.connector.read.PartitionReaderFactory;
import org.apache.spark.sql.connector.read.Scan;
import org.apache.spark.sql.connector.read.ScanBuilder;
import org.apache.spark.sql.connector.read.Statistics;
import org.apache.spark.sql.connector.read.SupportsPushDownFilters;
import org.apache.spark.sql.connector.read.SupportsPushDownRequiredColumns;
import org.apache.spark.sql.connector.read.SupportsReportStatistics;
import org.apache.spark.sql.sources.Filter;
import org.apache.spark.sql.types.DataType;
import org.apache.spark.sql.types.StructField;
import org.apache.spark.sql.types.StructType;
import org.apache.spark.sql.util.ArrowUtils;
import org.apache.spark.sql.vectorized.ArrowColumnVector;
import org.apache.spark.sql.vectorized.ColumnVector;
import org.apache.spark.sql.vectorized.ColumnarBatch;

/**
 * The read side: a sealed dataset as a DataFrame, one Spark partition per
 * stored partition, in partition order and row order (the dataset's own
 * row numbering), columns pruned on the server. Each partition reads the
 * unshuffled order from its first row and stops after its last.
 *
 * <p>With a filter (the {@code filter} option, and Spark's filters that
 * {@link Filters} translates) the server sends only the rows it selects,
 * still in the dataset's order. On a dataset sealed across servers each
 * stored partition with any selected rows is a Spark partition of just
 * those (the plan says how many each holds), served where it is held; on
 * one server the selected rows are split evenly over as many Spark
 * partitions as there are stored partitions, so a filter that selects from
 * few of them still makes as many tasks. Spark evaluates its own filters
 * again on what arrives, so a pushed filter only ever saves work.
 *
 * <p>The scan reports the dataset's size to Spark's planner; a count reads
 * nothing. A column stored as a type Spark does not hold is cast on the
 * server to the one it reads it as ({@link SparkTypes}); a read schema may
 * ask a column as another simple type, which the server casts it to too
 * (the columnar reader hands Spark the vectors as they arrive); anything
 * else that does not match the stored columns is refused when the read is
 * planned.
 */
final class FlightDeckScan {
  private FlightDeckScan() {}

  /** Prunes columns and pushes filters down; builds the scan. */
  static final class Builder
      implements ScanBuilder, SupportsPushDownRequiredColumns, SupportsPushDownFilters {
    private final Options options;
    private final StructType full;
    private StructType schema;
    private Filters.Pushed pushed = Filters.Pushed.NONE;

    Builder(Options options, StructType schema) {
      this.options = options;
      this.full = schema;
      this.schema = schema;
    }

    @Override
    public void pruneColumns(StructType required) {
      schema = required;
    }

    @Override
    public Filter[] pushFilters(Filter[] filters) {
      pushed = Filters.push(filters, full);
      // Spark evaluates every filter again after the scan.
      return filters;
    }

    @Override
    public Filter[] pushedFilters() {
      return pushed.filters().toArray(new Filter[0]);
    }

    @Override
    public Scan build() {
      return new DatasetScan(options, pushed, schema);
    }
  }

  /**
   * The scan of a dataset, reporting its size to Spark's planner: the
   * dataset's rows times Spark's estimate of a row of the columns read (no
   * row count with a filter, the size then an upper bound), so a small
   * dataset is broadcast into a join rather than shuffled.
   */
  static final class DatasetScan implements Scan, SupportsReportStatistics {
    private final Options base;
    /** Spark's filters the scan took (may be none). */
    private final Filters.Pushed pushed;
    /** The options with Spark's filters joined to the {@code filter} option. */
    private final Options options;
    private final StructType schema;
    /** The dataset's rows, asked of the server once, when Spark first wants them. */
    private Long rows;

    DatasetScan(Options base, Filters.Pushed pushed, StructType schema) {
      this.base = base;
      this.pushed = pushed;
      this.options = base.withFilter(pushed.sql());
      this.schema = schema;
    }

    @Override
    public StructType readSchema() {
      return schema;
    }

    @Override
    public String description() {
      return "flightdeck dataset '" + options.dataset() + "'"
          + (options.filter().isEmpty() ? "" : " where " + options.filter());
    }

    @Override
    public Batch toBatch() {
      return new Partitions(base, pushed, schema);
    }

    @Override
    public Statistics estimateStatistics() {
      if (rows == null) {
        try (Server server = Server.open(options.uri(), options.token())) {
          rows = server.sealed(options.dataset()).rows();
        }
      }
      long perRow = Math.max(1, schema.defaultSize());
      long size = rows > Long.MAX_VALUE / perRow ? Long.MAX_VALUE : rows * perRow;
      OptionalLong count = options.filter().isEmpty() ? OptionalLong.of(rows) : OptionalLong.empty();
      return new Statistics() {
        @Override
        public OptionalLong sizeInBytes() {
          return OptionalLong.of(size);
        }

        @Override
        public OptionalLong numRows() {
          return count;
        }
      };
    }
  }

  /**
   * A stored partition's rows: {@code rows} from global row {@code start}
   * (with a filter: of the selected rows, in order), of the dataset as
   * sealed when the read was planned ({@code sealedAs}, see {@link
   * Wire.DatasetInfo}): one written again meanwhile fails the task rather
   * than mixing two writes in one read. The stream ends with the rows; a
   * stored partition of a dataset sealed across servers is served by the
   * member holding it ({@code holder}; "": the plan's default).
   */
  record Part(
      Options options,
      List<String> columns,
      List<String> select,
      long start,
      long rows,
      long sealedAs,
      String holder)
      implements InputPartition, Serializable {
    /** The holder's host: Spark prefers an executor there, where the rows are. */
    @Override
    public String[] preferredLocations() {
      String host = holder.isEmpty() ? "" : ServerNames.host(holder);
      return host.isEmpty() ? new String[0] : new String[] {host};
    }
  }

  /**
   * The Spark types a read schema may ask a column as, whatever it is stored
   * as, and the Arrow type the server casts it to (DataFusion's
   * {@code arrow_cast}); a cast the values do not allow fails the read.
   */
  static final Map<String, String> CASTS = new LinkedHashMap<>();

  static {
    CASTS.put("boolean", "Boolean");
    CASTS.put("tinyint", "Int8");
    CASTS.put("smallint", "Int16");
    CASTS.put("int", "Int32");
    CASTS.put("bigint", "Int64");
    CASTS.put("float", "Float32");
    CASTS.put("double", "Float64");
    CASTS.put("string", "Utf8");
    CASTS.put("date", "Date32");
    CASTS.put("binary", "Binary");
  }

  /**
   * Plans one Spark partition per stored partition, from the dataset's
   * description: the {@code base} options (the {@code filter} option among
   * them) and {@code pushed}, Spark's filters the scan took.
   */
  record Partitions(Options base, Filters.Pushed pushed, StructType schema) implements Batch {
    @Override
    public InputPartition[] planInputPartitions() {
      Wire.DatasetInfo info;
      FlightInfo selected = null;
      List<String> select;
      Options options;
      try (Server server = Server.open(base.uri(), base.token())) {
        info = server.sealed(base.dataset());
        Conversions read = conversions(info.arrowSchema(), server.location);
        select = read.select();
        // Spark's filters compare the columns as the read schema types them;
        // a column the schema asks as another type compares otherwise
        // before the cast (a number against a string), so the filters on
        // one are left to Spark, which evaluates them all on what arrives
        // in any case. The casts to the type Spark holds keep every value.
        options = base.withFilter(pushed.without(read.retyped()).sql());
        if (!options.filter().isEmpty()) {
          selected = selectedRows(server, options, info.sealedAs());
        }
      }
      List<String> columns = Arrays.asList(schema.fieldNames());
      List<Wire.Partition> parts = new ArrayList<>(info.partitions());
      parts.sort(Comparator.comparingInt(Wire.Partition::partition));
      List<InputPartition> out = new ArrayList<>();
      long[] rows = parts.stream().mapToLong(Wire.Partition::rows).toArray();
      boolean cluster = parts.stream().anyMatch(p -> !p.holder().isEmpty());
      if (selected != null) {
        rows = Wire.planPartitionRows(selected.getAppMetadata());
        if (!cluster || rows.length != parts.size()) {
          // One server (or one that does not tell each partition's
          // selected rows): equal parts of them.
          long total = selected.getRecords();
          int n = Math.max(1, parts.size());
          for (int i = 0; i < n; i++) {
            long start = total * i / n;
            long end = total * (i + 1) / n;
            if (end > start) {
              out.add(new Part(
                  options, columns, select, start, end - start, info.sealedAs(), ""));
            }
          }
          return out.toArray(new InputPartition[0]);
        }
      }
      long start = 0;
      for (int i = 0; i < parts.size(); i++) {
        // Served by the member holding it, nothing fetched from the others.
        if (rows[i] > 0 || selected == null) {
          out.add(new Part(options, columns, select, start, rows[i], info.sealedAs(),
              parts.get(i).holder()));
        }
        start += rows[i];
      }
      return out.toArray(new InputPartition[0]);
    }

    /**
     * What the read asks of the server for the read schema (one given to
     * the read may differ from the stored columns): nothing where every
     * column is read as stored, else a select list that casts on the server
     * each column Spark holds only as another type ({@link SparkTypes}) or
     * wants as another type ({@link #CASTS}), since the columnar reader
     * hands Spark the vectors as they arrive. A column the
     * dataset lacks, or a type it is not cast to, is refused here, naming
     * it, rather than failing every task.
     */
    private Conversions conversions(Schema stored, String location) {
      List<String> select = new ArrayList<>();
      boolean cast = false;
      Set<String> retyped = new HashSet<>();
      for (StructField want : schema.fields()) {
        Field field = stored.getFields().stream()
            .filter(f -> f.getName().equals(want.name()))
            .findFirst()
            .orElseThrow(() -> new FlightDeckException("INVALID_ARGUMENT", "the read's schema "
                + "names column '" + want.name() + "', which dataset '" + base.dataset()
                + "' on " + location + " does not have; its columns are "
                + stored.getFields().stream().map(Field::getName).toList()));
        String name = Filters.quote(want.name());
        SparkTypes.Read read = SparkTypes.read(field);
        DataType have = read == null ? null : read.type();
        if (have != null && have.simpleString().equals(want.dataType().simpleString())) {
          // As stored, or as the server casts it to the type Spark holds.
          if (read.field() == field) {
            select.add(name);
          } else {
            select.add(cast(name, SparkTypes.castName(read.field())));
            cast = true;
          }
          continue;
        }
        String target = CASTS.get(want.dataType().simpleString());
        if (target == null) {
          throw new FlightDeckException("INVALID_ARGUMENT", "the read's schema gives column '"
              + want.name() + "' of dataset '" + base.dataset() + "' as "
              + want.dataType().simpleString() + ", but it is stored as "
              + FlightDeckDataSource.typeName(field) + "; the JVM connector reads a column as "
              + "stored" + (have == null ? "" : " (" + have.simpleString() + ")") + " or cast to "
              + String.join(", ", CASTS.keySet()) + ": give one of those, or leave it out");
        }
        select.add(cast(name, target));
        cast = true;
        retyped.add(want.name());
      }
      return new Conversions(cast ? select : List.of(), retyped);
    }

    /**
     * What a read asks of the server: its select list (empty: every column
     * as stored), and the columns it casts to another type than the stored
     * one's Spark type (the read schema asked so).
     */
    private record Conversions(List<String> select, Set<String> retyped) {}

    /** The select item that has the server cast column {@code name} to Arrow type {@code type}. */
    private static String cast(String name, String type) {
      return "arrow_cast(" + name + ", '" + type.replace("'", "''") + "') AS " + name;
    }

    /** The plan of the filter's rows, from {@code server}: its row count and each partition's. */
    private static FlightInfo selectedRows(Server server, Options options, long sealedAs) {
      byte[] plan = Wire.readFrom(options.dataset(), 0, 0, options.batchRows(), List.of(),
          List.of(), options.filter(), sealedAs, "");
      try {
        return server.client.getInfo(FlightDescriptor.command(plan), server.options);
      } catch (FlightRuntimeException e) {
        throw FlightDeckException.of(e, server.location);
      }
    }

    @Override
    public PartitionReaderFactory createReaderFactory() {
      return new Readers();
    }
  }

  /** Columnar readers: Arrow vectors straight from the stream, no row copy. */
  static final class Readers implements PartitionReaderFactory {
    private static final long serialVersionUID = 1L;

    @Override
    public boolean supportColumnarReads(InputPartition partition) {
      return true;
    }

    @Override
    public PartitionReader<InternalRow> createReader(InputPartition partition) {
      throw new UnsupportedOperationException("flightdeck partitions are read as columns");
    }

    @Override
    public PartitionReader<ColumnarBatch> createColumnarReader(InputPartition partition) {
      Part part = (Part) partition;
      return part.columns().isEmpty() ? new Counted(part) : new Reader(part);
    }
  }

  /**
   * A partition of which Spark wants no column ({@code count()}, a literal
   * per row): its rows, which the plan already counted, as batches without
   * vectors, and nothing read from the server (an empty projection asks the
   * server for every column).
   */
  static final class Counted implements PartitionReader<ColumnarBatch> {
    private long remaining;
    private ColumnarBatch batch;

    Counted(Part part) {
      this.remaining = part.rows();
    }

    @Override
    public boolean next() {
      if (remaining <= 0) {
        return false;
      }
      int rows = (int) Math.min(remaining, Integer.MAX_VALUE);
      batch = new ColumnarBatch(new ColumnVector[0], rows);
      remaining -= rows;
      return true;
    }

    @Override
    public ColumnarBatch get() {
      return batch;
    }

    @Override
    public void close() {}
  }

  /** One stored partition's rows, batch by batch. */
  static final class Reader implements PartitionReader<ColumnarBatch> {
    private final BufferAllocator allocator;
    private final List<Server> servers = new ArrayList<>();
    private final FlightStream stream;
    private final int columns;
    private final long start;
    private long remaining;
    private ColumnarBatch batch;

    Reader(Part part) {
      Options o = part.options();
      this.remaining = part.rows();
      this.start = part.start();
      this.columns = part.columns().size();
      this.allocator = ArrowUtils.rootAllocator()
          .newChildAllocator("flightdeck read from row " + part.start(), 0, Long.MAX_VALUE);
      Server server = Server.connect(o.uri(), o.token(), allocator);
      servers.add(server);
      try {
        FlightInfo info = server.client.getInfo(
            FlightDescriptor.command(
                Wire.readFrom(o.dataset(), part.start(), part.rows(), o.batchRows(),
                    part.select().isEmpty() ? part.columns() : List.of(), part.select(),
                    o.filter(), part.sealedAs(), part.holder())),
            server.options);
        FlightEndpoint endpoint = info.getEndpoints().get(0);
        Server serving = server;
        // On a dataset sealed across servers, the member that serves it.
        List<Location> at = endpoint.getLocations();
        if (!at.isEmpty()) {
          String location = at.get(0).getUri().toString();
          if (!ServerNames.normalize(location, "").equals(server.location)) {
            serving = Server.connect(location, o.token(), allocator);
            servers.add(serving);
          }
        }
        this.stream = serving.client.getStream(endpoint.getTicket(), serving.options);
      } catch (FlightRuntimeException e) {
        close();
        throw FlightDeckException.of(e, server.location);
      }
    }

    @Override
    public boolean next() {
      if (remaining <= 0) {
        return false;
      }
      if (!stream.next()) {
        // Never a partition cut short as if complete.
        throw new FlightDeckException("INTERNAL", "the stream of rows from " + start
            + " ended " + remaining + " rows short of its partition; read the dataset again");
      }
      VectorSchemaRoot root = stream.getRoot();
      ColumnVector[] vectors = new ColumnVector[columns];
      for (int i = 0; i < columns; i++) {
        vectors[i] = new ArrowColumnVector(root.getVector(i));
      }
      int rows = (int) Math.min(root.getRowCount(), remaining);
      batch = new ColumnarBatch(vectors, rows);
      remaining -= rows;
      return true;
    }

    @Override
    public ColumnarBatch get() {
      return batch;
    }

    @Override
    public void close() {
      try {
        if (stream != null) {
          if (remaining <= 0) {
            // The rest of the order belongs to the next partitions.
            stream.cancel("read its partition", null);
          }
          stream.close();
        }
      } catch (Exception e) {
        // Closing a cancelled stream: nothing left to read.
      } finally {
        for (Server s : servers) {
          s.close();
        }
        allocator.close();
      }
    }
  }
}
